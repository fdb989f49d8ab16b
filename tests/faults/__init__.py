"""Process-killing suites: real processes SIGKILLed and SIGSTOPped, Redis killed, Sentinel failovers."""
