"""Fixtures of the weight tests: ``ckpt``, a synthetic safetensors checkpoint of the shared small case
(:mod:`tests.weights.helpers`), one per test module."""

from __future__ import annotations

import pytest

from tests.weights.helpers import E, L


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from fdeplb.weights import write_synthetic_checkpoint  # its paddle / safetensors import only where one is used

    return write_synthetic_checkpoint(tmp_path_factory.mktemp("ernie"), L, E, experts_per_shard=5, seed=3)
