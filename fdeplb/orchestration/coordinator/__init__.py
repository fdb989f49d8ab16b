"""The coordinator process: drives one cluster's rearrangement machine while it holds the lease.

:class:`Coordinator` (``round_loop.py``: the reconcile loop and :data:`ENTRY_WORK`) is this package's face; the
round's entry work per phase lives beside it (``round_start.py``: FREE; ``round_planning.py``: COLLECTING and
PLANNING; ``round_switch.py``: LOADING to DONE), over ``entry_step.py`` (what an entry work returns, when a failed
step is retried).
"""

from fdeplb.orchestration.coordinator.round_loop import ABORTABLE, ENTRY_WORK, RETRY_MS, Coordinator, Step

__all__ = ["ABORTABLE", "ENTRY_WORK", "RETRY_MS", "Coordinator", "Step"]
