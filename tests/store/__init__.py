"""Tests of fdeplb.store: the Redis boundary and its Lua scripts."""
