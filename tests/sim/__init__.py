"""Tests of fdeplb.sim: the simulated cluster and ``fdeplb demo``."""
