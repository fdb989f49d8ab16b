"""Tests of fdeplb.machines: the tables over Redis and the state diagrams."""
