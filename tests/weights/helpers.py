"""The small case the paddle weight tests share: 3 MoE layers, 8 logical experts, 2 ranks of 6 slots (4 redundant),
placements OLD and NEW, and a byte snapshot of a rank's live slots."""

from __future__ import annotations

import numpy as np

L, E, EP = 3, 8, 2  # 3 MoE layers, 8 logical experts, 2 ranks of 6 slots (4 redundant)

OLD = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]] * L)
NEW = np.array(
    [
        [1, 0, 2, 7, 7, 5, 6, 4, 0, 3, 2, 1],  # rank 0: slots 0/1 exchange experts, 7 is new in two slots
        [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3],  # unchanged
        [5, 5, 5, 5, 5, 7, 0, 1, 2, 3, 4, 6],  # rank 0: 5 copied into five slots before its slot loads 7
    ]
)


def snapshot_bytes(live) -> dict[str, list[bytes]]:
    """The bytes of every live slot tensor of ``live`` (a :class:`~fdeplb.weights.LiveExperts`), by slot name."""
    return {s: [t.numpy().tobytes() for t in layers] for s, layers in live.tensors.items()}
