"""Tests of fdeplb.placement: policies, metrics, load readers, placement files and ``fdeplb rebalance``."""
