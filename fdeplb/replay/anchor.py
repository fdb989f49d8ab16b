"""Anchoring a replayed recording's audit chain to a live cluster: :func:`check_head` compares the chain the replay
reached with the live audit stream's record of the same id and, when the recording ends where the stream ends, with
the live audit head (``Store.audit_head()``), the value ``commit.lua`` / ``audit.lua`` keep beside the stream.

A recording's chain only proves its records follow from each other: a forger who edits a record and recomputes
every chain after it passes the self-contained replay. The live store holds the trusted end of the chain, so
``fdeplb replay FILE --redis-url URL --cluster ID`` fails such a recording here. The header's configuration is
anchored the same way: where the chain matches, it must be the live configuration as it was at the recording's end
(every setting, also those no record shows). Reads only.
"""

from __future__ import annotations

from fdeplb.errors import InputError, ReplayError
from fdeplb.replay.header_checks import config_before
from fdeplb.replay.report import ReplayReport
from fdeplb.store import ClusterConfig
from fdeplb.store.streams import parse_stream_id

__all__ = ["check_head"]


def _sid(text: str) -> tuple[int, int]:
    return parse_stream_id(text)


def check_head(store, report: ReplayReport) -> str:
    """Compare ``report``'s last chain (the last chained record the replay verified) with ``store``'s live audit
    (a :class:`~fdeplb.store.Store`). Returns what it found, also in ``report.head``:

    - ``matches``: the recording ends at the stream's end and its chain is the live audit head;
    - ``matches record``: the stream went on after the recording (or ``--until`` stopped before its end); the live
      record with the recording's last id has the same chain;
    - ``trimmed``: that record is older than the stream's first (the audit was trimmed): nothing to compare;
    - ``no chain``: the recording has no chained record (an export older than the chain).

    Raises :class:`ReplayError` naming the recording's last chained line when the chains differ, when the live
    stream has no record with that id inside its span, or when the recording goes past the stream's end.
    """
    if not report.chained or not report.chain_id:
        report.head = "no chain"
        return report.head
    where, rid = report.chain_where, report.chain_id
    try:
        mine = _sid(rid)
    except InputError as exc:
        raise ReplayError(f"{where}: {exc}") from None
    last = store.last_audit_id()
    if last == "0-0" or mine > _sid(last):
        raise ReplayError(f"{where}: the live audit of cluster {store.cluster!r} ends at {last}, before this "
                          f"record: the recording has records the cluster never committed")
    live = store.audit(rid, rid)
    if not live:
        first = store.audit("-", "+", count=1)
        if first and mine < _sid(first[0].id):
            report.head = "trimmed"
            return report.head
        raise ReplayError(f"{where}: the live audit of cluster {store.cluster!r} has no record {rid}: the "
                          f"recording has a record the cluster never committed")
    if live[0]["chain"] != report.chain:
        raise ReplayError(f"{where}: chain {report.chain} differs from the live audit's record {rid} "
                          f"({live[0]['chain']}): the recording was edited and its chain recomputed, or is of "
                          f"another cluster")
    if last == rid:
        head = store.audit_head()
        if head != report.chain:
            raise ReplayError(f"{where}: the recording ends at the stream's end, but its chain {report.chain} is "
                              f"not the live audit head {head}")
        report.head = "matches"
    else:
        report.head = "matches record"
    _check_config(store, report)
    return report.head


def _check_config(store, report: ReplayReport) -> None:
    """The header's configuration against the live one at the recording's end (the live configuration with the
    ``config_changed`` notes after the recording undone, :func:`fdeplb.replay.header_checks.config_before`). Left out for a
    round's export (an older round's export holds the configuration at the export, not at its end) and with
    ``--until``. :class:`ReplayError` ``line 1:`` naming each setting that differs."""
    header = report.header
    if header is None or report.until is not None or (header.get("range") or {}).get("round") is not None:
        return
    last = str(report.audit[-1].get("id", "")) if report.audit else ""
    later = store.audit(f"({last}", "+") if last and report.head == "matches record" else []
    live = config_before(store.read_config(fresh=True), later).to_json()
    mine = ClusterConfig.from_json(header["config"]).to_json()
    differ = [f"{name} {mine[name]!r} (live {live[name]!r})" for name in live if mine.get(name) != live[name]]
    if differ:
        raise ReplayError(f"line 1: the header's configuration differs from the live cluster's at the recording's "
                          f"end: {', '.join(differ)}")
