"""What a cluster keeps and how much: pruning old snapshots and plans by the retention index, the opt-in audit
trim (exported first to a JSONL file, :mod:`fdeplb.store.audit_export`), and the counts that show nothing leaks
(keys, server memory).

Uses from :class:`~fdeplb.store.base.StoreBase`: ``_client``, ``_keys``, ``_audit_trim``; from
:mod:`fdeplb.store.streams`: ``audit``, ``audit_length``.
"""

from __future__ import annotations

import json
import os

from fdeplb.errors import FenceError
from fdeplb.store.audit_export import append_lines, open_export
from fdeplb.store.connection import as_str as _s
from fdeplb.store.scripts import audit_trim_call
from fdeplb.store.streams import parse_stream_id


class Retention:
    """Pruning, audit trimming and key counts (see the module doc)."""

    def prune(self, keep_rounds: int, keep_plan_ids: tuple[str, ...] = ()) -> list[str]:
        """Delete the load snapshots and plans written by rounds older than the last ``keep_rounds`` (counted from
        the newest indexed round), except the plans named in ``keep_plan_ids`` (the current placement's, the round
        in flight's) and the snapshot of a kept plan's round. Returns the deleted keys (sorted).

        Only keys in the retention index (written by :meth:`save_snapshot` / :meth:`save_plan`) are considered."""
        newest = self._client.zrevrange(self._keys.retained, 0, 0, withscores=True)
        if not newest:
            return []
        cutoff = int(newest[0][1]) - int(keep_rounds)  # rounds <= cutoff are pruned
        keep = {self._keys.plan(p) for p in keep_plan_ids if p}
        keep_rounds_of_plans = set()
        for key in keep:
            score = self._client.zscore(self._keys.retained, key)
            if score is not None:
                keep_rounds_of_plans.add(self._keys.snapshot(int(score)))
        old = [_s(k) for k in self._client.zrangebyscore(self._keys.retained, "-inf", cutoff)]
        drop = sorted(k for k in old if k not in keep and k not in keep_rounds_of_plans)
        if drop:
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(*drop)
            pipe.zrem(self._keys.retained, *drop)
            pipe.execute()
        return drop

    def retained_keys(self) -> dict[str, int]:
        """Snapshot and plan keys in the retention index -> the round that wrote them."""
        return {_s(k): int(v) for k, v in self._client.zrange(self._keys.retained, 0, -1, withscores=True)}

    def trim_audit(self, keep: int, export_path: str, audit_dir: str | None, *, fence: str) -> int:
        """Opt-in audit retention: append every audit record but the newest ``keep`` to ``export_path`` (JSONL,
        one ``{"id": ..., **fields}`` object per line, flushed and fsynced), a regular file confined to
        ``audit_dir`` (:func:`~fdeplb.store.audit_export.open_export`), and only then trim them from the stream
        (``lua/audit_trim.lua``: ``XTRIM MINID``, records appended meanwhile stay), fenced by the coordinator's
        lease value ``fence`` ("" = unfenced). Returns how many were trimmed (0 when the stream holds ``keep`` or
        fewer).

        The export resumes by stream id (:func:`~fdeplb.store.audit_export.append_lines`): records the file holds
        already (an earlier attempt cut short, another coordinator's export) are not written again, so each record
        is exported once, in order, whatever ``keep`` was then; only when the file's last record is this cluster's
        (its id and chain in the batch or still in the stream), so another cluster's records in the same file
        never make it skip (and trim) its own.

        Raises :class:`~fdeplb.errors.InputError` when the export is refused (outside ``audit_dir``, no
        ``audit_dir``, a symbolic or hard link, a device, a FIFO) and OSError when it cannot be written: nothing is
        trimmed then (lines written before a failed write stay in the file; the next trim resumes after them).
        Raises :class:`~fdeplb.errors.FenceError` when ``fence`` no longer holds the lease (a paused or deposed
        coordinator): nothing is trimmed (what it exported stays in the file, each record once)."""
        length = self.audit_length()
        if keep < 1 or length <= keep:
            return 0
        old = self.audit("-", "+", count=length - keep)
        if not old:
            return 0
        chains = {entry.id: entry.fields.get("chain") for entry in old}
        batch_end = parse_stream_id(old[-1].id)

        def ours(record: dict) -> bool:  # a record of the export file: one of this cluster's (by id and chain)?
            rid = str(record["id"])
            if rid in chains:
                return chains[rid] == record.get("chain")
            if parse_stream_id(rid) <= batch_end:  # the stream's records up to there are all in the batch
                return False
            held = self.audit(rid, rid, count=1)  # one of the newest `keep`, exported by an earlier attempt?
            return bool(held) and held[0].fields.get("chain") == record.get("chain")

        with open_export(export_path, audit_dir) as fh:
            append_lines(fh, [json.dumps({"id": entry.id, **entry.fields}, sort_keys=True) + "\n" for entry in old],
                         ours)
            fh.flush()
            os.fsync(fh.fileno())
        ms, seq = parse_stream_id(old[-1].id)
        call = audit_trim_call(self._keys, fence=fence, minid=f"{ms}-{seq + 1}")
        reply = self._audit_trim(keys=call.keys, args=call.args)
        if _s(reply[0]) != "OK":
            raise FenceError(f"audit trim refused: {_s(reply[1])}; nothing trimmed")
        return len(old)

    def key_count(self) -> int:
        """Keys of this cluster now (SCAN; used to check that nothing leaks). The tombstone an operator's delete
        leaves (:attr:`Keys.deleted`) is not one: it says the cluster is not there."""
        return sum(1 for k in self._client.scan_iter(match=self._keys.pattern) if _s(k) != self._keys.deleted)

    def memory_used(self) -> int:
        """The server's ``used_memory`` in bytes (the sum over the nodes of a Redis Cluster)."""
        info = self._client.info("memory")
        if isinstance(info, dict) and "used_memory" in info:
            return int(info["used_memory"])
        return sum(int(v["used_memory"]) for v in info.values())  # RedisCluster: one dict per node
