"""The coordinator lease: ``SET NX PX`` plus a monotonic fencing counter, taken, renewed and given back through
``lua/lease.lua``; the lease value ``<fence>:<holder>`` is the fencing token commits carry.

Uses from :class:`~fdeplb.store.base.StoreBase`: ``_client``, ``_keys``, ``_lease`` (the registered script).
"""

from __future__ import annotations

from typing import Any

import redis

from fdeplb.errors import CorruptRecordError
from fdeplb.store.connection import as_str as _s
from fdeplb.store.records import LeaseInfo
from fdeplb.store.scripts import lease_call


class Lease:
    """The coordinator lease (see the module doc)."""

    def _lease_op(self, op: str, value: str, ttl_ms: int) -> Any:
        call = lease_call(self._keys, op, value, ttl_ms)
        return self._lease(keys=call.keys, args=call.args)

    def acquire_lease(self, holder: str, ttl_ms: int) -> str | None:
        """Take the coordinator lease if free; returns the lease value ``<fence>:<holder>`` (the fencing token).
        :class:`CorruptRecordError` naming the fence key when the fence counter holds something else than a
        non-negative integer (nothing is changed then)."""
        try:
            value = self._lease_op("acquire", holder, ttl_ms)
        except redis.ResponseError as exc:
            if "corrupt fence counter" in str(exc):
                raise CorruptRecordError(str(exc).split("lease.lua: ", 1)[-1], key=self._keys.fence) from None
            raise
        return _s(value) if value else None

    def renew_lease(self, value: str, ttl_ms: int) -> bool:
        """Extend the lease if ``value`` still holds it; False means the lease was lost."""
        return bool(self._lease_op("renew", value, ttl_ms))

    def release_lease(self, value: str) -> bool:
        """Give the lease back if ``value`` still holds it."""
        return bool(self._lease_op("release", value, 0))

    def lease_info(self) -> LeaseInfo:
        """Who holds the coordinator lease and for how long still."""
        pipe = self._client.pipeline(transaction=True)
        pipe.get(self._keys.lease)
        pipe.pttl(self._keys.lease)
        value, ttl = pipe.execute()
        if not value:
            return LeaseInfo(holder=None, ttl_ms=None)
        return LeaseInfo(holder=_s(value), ttl_ms=int(ttl) if ttl is not None and int(ttl) >= 0 else None)
