"""Tests of fdeplb.cli: the operator's commands against a real Redis."""
