"""One rank's routing tables on its device: ``phy2log`` / ``log2phy`` / ``logcnt`` as paddle int64 tensors, rewritten
in place (whole, or a chunk's rows as checked row copies), so every reference the serving engine holds stays valid.

The tables' contents are :func:`fdeplb.weights.plan.routing_tables` of a placement, over the routed ranks' slots.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fdeplb.weights import _paddle
from fdeplb.weights.plan import routing_tables


class RoutingTables:
    """The device routing tables of one rank, updated in place.

    Args:
        phy2log: int [L, P], the placement the tables start with (routed over every rank).
        num_logical_experts: E.
        max_replicas: width of ``log2phy`` (fixed, so the tables are rewritten in place).
        device: where the tables live (a device string :func:`~fdeplb.weights._paddle.resolve_device` returned).

    Attributes:
        phy2log: int64 [L, P]; log2phy: int64 [L, E, max_replicas] (-1 padded); logcnt: int64 [L, E] (paddle).
    """

    def __init__(self, phy2log: np.ndarray, num_logical_experts: int, max_replicas: int, device: str) -> None:
        self.num_logical_experts, self.max_replicas, self.device = num_logical_experts, max_replicas, device
        log2phy, logcnt = self.of(phy2log)
        self.phy2log = self.to_device(phy2log)
        self.log2phy = self.to_device(log2phy)
        self.logcnt = self.to_device(logcnt)

    def of(self, phy2log: np.ndarray, live: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(log2phy, logcnt)`` (numpy int64) of ``phy2log`` routed over ``live`` (bool [ep_size]; None: every
        rank). Raises RedundancyError when an expert has no live replica."""
        return routing_tables(phy2log, self.num_logical_experts, self.max_replicas, live)

    def to_device(self, arr: np.ndarray) -> Any:
        """A new int64 paddle tensor on the tables' device holding ``arr``."""
        return _paddle.paddle().to_tensor(np.ascontiguousarray(arr, dtype=np.int64), place=_paddle.place_of(self.device))

    def write(self, phy2log: np.ndarray, live: np.ndarray | None = None) -> None:
        """Rewrite the tables in place for ``phy2log`` routed over ``live`` (None: every rank)."""
        self.write_tables(phy2log, *self.of(phy2log, live))

    def write_tables(self, phy2log: np.ndarray, log2phy: np.ndarray, logcnt: np.ndarray) -> None:
        """Copy whole tables (numpy) into the device tables in place, and wait for the copies."""
        for dst, arr in ((self.phy2log, phy2log), (self.log2phy, log2phy), (self.logcnt, logcnt)):
            _paddle.copy_into(dst, self.to_device(arr))
        _paddle.synchronize(self.device)

    def row_copies(self, new: np.ndarray, chunk: list[int], live: np.ndarray | None) -> list[Any]:
        """The :class:`~fdeplb.weights._paddle.RowCopy` s that switch the rows of ``chunk`` (sorted layers) to
        ``new`` (int [L, P]) routed over ``live``: one block of rows per run of consecutive layers and table."""
        log2phy, logcnt = self.of(new[chunk], live)
        copies = []
        for lo, hi in _runs(chunk):
            a, b = chunk.index(lo), chunk.index(hi) + 1
            blocks = (self.to_device(new[lo:hi + 1]), self.to_device(log2phy[a:b]), self.to_device(logcnt[a:b]))
            copies += [_paddle.RowCopy(table, lo, block, 0, hi + 1 - lo)
                       for table, block in zip((self.phy2log, self.log2phy, self.logcnt), blocks)]
        return copies


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """``(first, last)`` of each run of consecutive integers in the sorted ``values``."""
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and runs[-1][1] + 1 == v:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs
