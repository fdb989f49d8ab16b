"""What a coordinator's entry work returns, which states a failing step aborts in, and when it is retried."""

from __future__ import annotations

from fdeplb.machines.tables import CLUSTER, ClusterState


#: what a state's entry work returns: (progressed, ms until the next deadline or None)
Step = tuple[bool, "int | None"]

#: states the ``abort`` trigger leaves (before the commit point): a failing step there ends in an abort
ABORTABLE = frozenset(CLUSTER.spec(ClusterState.COLLECTING, "abort").sources)
#: how long a failing step waits before it is retried (ms); at most a third of the lease (:meth:`Coordinator._retry_ms`)
RETRY_MS = 1_000


__all__ = ["ABORTABLE", "RETRY_MS", "Step"]

