"""Tests of fdeplb.replay: replaying exported audits and the recordings of tests/replays/."""
