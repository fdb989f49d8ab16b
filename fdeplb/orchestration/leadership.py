"""The coordinator's leadership: one coordinator leads per cluster, by a lease (``SET NX PX``) and a monotonic
fence (``store/lua/lease.lua``) that every cluster commit carries, so that a deposed leader commits nothing.

:class:`Leadership` is mixed into :class:`~fdeplb.orchestration.coordinator.Coordinator`: holder ids, acquiring,
renewing and releasing the lease, and firing a cluster trigger with the fence.
"""

from __future__ import annotations

import os
import re
import socket
import time
import uuid
from typing import Any

from fdeplb.checks import check_int
from fdeplb.errors import FdeplbError, InputError
from fdeplb.failpoints import failpoint
from fdeplb.machines.tables import CLUSTER
from fdeplb.orchestration.handles import RecordHandle
from fdeplb.orchestration.reconcile import StopsWhenDeleted
from fdeplb.store import ClusterRecord

#: longest holder id (a hostname is at most 253 characters; the default adds pid and a random suffix)
MAX_HOLDER = 300
_HOLDER = re.compile(f"[!-~]{{1,{MAX_HOLDER}}}")


def check_holder(holder: str) -> str:
    """``holder`` if it is a valid coordinator holder id (1 to :data:`MAX_HOLDER` printable ASCII characters, no
    spaces: it is the actor of every audit record the coordinator writes); :class:`InputError` otherwise."""
    if not (isinstance(holder, str) and _HOLDER.fullmatch(holder)):
        raise InputError(f"holder must be 1 to {MAX_HOLDER} printable ASCII characters without spaces, got "
                         f"{str(holder)[:80]!r}{'...' if len(str(holder)) > 80 else ''}")
    return holder


def default_holder_id() -> str:
    return f"coordinator@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Leadership(StopsWhenDeleted):
    """The lease of one coordinator. It uses, of its host: ``store`` and ``log``.

    Attributes:
        holder: this coordinator's id (the actor of its audit records).
        lease_ms: the lease's time to live (ms), renewed every third of it.
        lease: the lease value (the fence its commits carry) while this coordinator leads, else None.
    """

    store: Any
    log: Any

    def _init_leadership(self, holder: str | None, lease_ms: int) -> None:
        """``holder``: :func:`check_holder` (None: :func:`default_holder_id`); ``lease_ms``: an integer in
        [300, 3600000]. Raises :class:`InputError` for either."""
        if holder is not None:
            check_holder(holder)
        self.lease_ms = check_int(lease_ms, "lease_ms", lo=300, hi=3_600_000)
        self.holder = holder or default_holder_id()
        self.lease: str | None = None
        self._renewed_at = 0.0  # time.monotonic() of the last acquire / renewal
        self._standing_by = False
        self._handle: RecordHandle | None = None

    def ensure_leadership(self) -> bool:
        """Acquire or renew the lease; True while this coordinator leads. The lease is renewed once a third of its
        TTL has passed since the last renewal, timed on the local monotonic clock (elapsed time, as the server
        counts a key's TTL: no round trip to ask the server's clock at every step)."""
        now = time.monotonic()
        if self.lease is not None:
            if now - self._renewed_at < self.lease_ms / 3000:
                return True
            if self.store.renew_lease(self.lease, self.lease_ms):
                self._renewed_at = now
                return True
            self.log.warning("lease lost", lease=self.lease)
            self.lease = None
        if self._stop_if_deleted():  # acquiring would write the lease and its fence anew
            return False
        value = self.store.acquire_lease(self.holder, self.lease_ms)
        if value:
            self.lease = value
            self._renewed_at = now
            self._standing_by = False
            self.log.info("leading", lease=value)
        elif not self._standing_by:  # said once per stretch of standing by, with the leader it waits on
            self._standing_by = True
            self.log.info("standing by", leader=self.store.lease_info().holder)
        return self.lease is not None

    def _release_leadership(self) -> None:
        """Give the lease back (as the loop ends); if that fails it expires on its own."""
        if self.lease is not None:
            try:
                self.store.release_lease(self.lease)
            except FdeplbError:
                pass  # it expires on its own
            self.lease = None

    def _fire(self, rec: ClusterRecord, trigger: str, **kwargs: Any) -> None:
        """Fire a cluster trigger with this coordinator's fence (the ``coordinator.stop`` failpoint sits here)."""
        failpoint("coordinator.stop", rec.state,
                  lambda: self.store.emit_event("failpoint", name="coordinator.stop", state=rec.state,
                                                holder=self.holder))
        if self._handle is None or self._handle.fence != (self.lease or ""):  # one per lease: reuses its machine
            self._handle = RecordHandle(self.store, CLUSTER, actor=self.holder, fence=self.lease or "")
        self._handle.fire(trigger, record=rec, **kwargs)
