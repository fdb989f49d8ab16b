"""The chunked swap (load_chunk + swap_layers, the threaded batch of disk writes) against the whole swap on random
placements: duplicate experts on a rank, copy chains, cycles (snapshots), disk writes into slots that are a local
copy's source, budgets from one layer per safe point to less than one expert. ``FDEPLB_CHUNK_SEEDS`` runs more."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("paddle")

from fdeplb.weights import CheckpointBackend, write_synthetic_checkpoint  # noqa: E402
from fdeplb.weights.plan import PauseBudget, changed_layers, chunk_layers  # noqa: E402

L, E, EP, S = 4, 8, 2, 6


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory):
    # ~768 KiB experts: a chunk's disk writes exceed 4 blocks of 256 KiB, so the batch really uses threads
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("chunk_fuzz"), L, E, hidden=256, intermediate=256, seed=7)


def placement(rng) -> np.ndarray:
    rows = []
    for _ in range(L):
        row = np.concatenate([rng.permutation(E), rng.integers(0, E, EP * S - E)])
        rows.append(rng.permutation(row))
    return np.array(rows, dtype=np.int64)


def snap(live) -> dict:
    return {s: [t.numpy().tobytes() for t in layers] for s, layers in live.tensors.items()}


@pytest.mark.parametrize("seed", range(int(os.environ.get("FDEPLB_CHUNK_SEEDS", "12"))))
def test_chunked_equals_whole_on_random_placements(big_ckpt, seed):
    rng = np.random.default_rng(seed)
    old, new = placement(rng), placement(rng)
    new[rng.integers(0, L)] = old[rng.integers(0, L)] if seed % 3 == 0 else new[0]  # sometimes a layer unchanged-ish
    rank = seed % EP
    whole = CheckpointBackend.open({"path": str(big_ckpt)}, old, rank, EP, device="cpu")
    whole.swap(whole.stage(new, None), new)
    b = CheckpointBackend.open({"path": str(big_ckpt)}, old, rank, EP, device="cpu")
    budgets = [PauseBudget(0, 1), PauseBudget(1, 0), PauseBudget(b.reader.expert_nbytes * 3, 0), PauseBudget(0, 2)]
    staged = b.stage(new, None, budgets[seed % len(budgets)])
    for layers in chunk_layers(staged.starts, changed_layers(old, new)):
        b.prepare(staged, new, layers)
        b.swap_layers(staged, new, layers)
    assert np.array_equal(b.phy2log, new)
    assert snap(b.live) == snap(whole.live)
    assert b.verify() == (L * S, L * S)
    for t in ("phy2log_tensor", "log2phy", "logcnt"):
        assert np.array_equal(getattr(b.live, t).numpy(), getattr(whole.live, t).numpy())
