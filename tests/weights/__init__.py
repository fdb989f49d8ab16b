"""Tests of fdeplb.weights: checkpoints, staging, verified swaps and transfer plans."""
