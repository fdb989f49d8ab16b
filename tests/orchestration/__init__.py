"""Tests of fdeplb.orchestration: coordinator and rank agents over a real Redis (thread clusters)."""
