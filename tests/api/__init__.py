"""Tests of fdeplb.api: the HTTP API in a thread and ``fdeplb serve`` processes."""
