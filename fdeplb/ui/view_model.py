"""The UI's read model: what the ``/ui`` page shows, computed here (the page only draws it).

One view dict serves both modes, the live cluster (:class:`LiveReadModel`, over a :class:`~fdeplb.store.Store`)
and the recording player (:class:`fdeplb.ui.player.PlayerModel`); both build it with :func:`build_view` from

- the cluster record's fields (``rearrange`` of :func:`fdeplb.status.cluster_status`, or a replayed fold),
- one row per rank (state, weight status, membership, heartbeat age, stale, step, staged bytes),
- audit records (JSON-ready dicts, :func:`fdeplb.recording.audit_dict`), oldest first,
- the last plan (:class:`~fdeplb.store.PlanEntry`) and the configuration.

View dict (JSON-ready)::

    {"mode": "live" | "player", "cluster": id, "redis": "ok", "now_ms": int,
     "summary": {"state" (None: no records), "round", "plan_id", "deadline_left_ms" (ms | None), "reason",
                 "alarm", "generation", "version", "cordoned" (bool)},
     "waiting": None | {"plan_id", "round", "command", "deadline_left_ms", "balancedness_before",
                        "balancedness_after", "moved_experts" (None: the plan is not at hand), "title", "text",
                        "also"},
                # a cordoned cluster's round staged in LOAD_SUCC, waiting for an operator's commit (``command``)
     "gone": None | {"title", "text", "last_seen": None | {"state", "round", "version", "plan_id", "at_ms"}},
                # Redis holds no records of the cluster (live only; everything else is then empty)
     "recreated": None | {"title", "text", "last_seen": {...}},
                # the cluster was created anew (another incarnation) since this server last saw it: the rounds
                # and audit before are gone (live only; said until the new cluster's first round)
     "states": {machine: [its states, in table order]},
     "current": {machine: {state: number of records in it}},   # every machine of TABLES
     "last": {machine: {"id", "from", "to", "trigger", "key"} | None},   # the transition last taken
     "ranks": [{"ep_rank", "state", "weights", "membership", "stale" (bool | None), "heartbeat_age_ms",
                "heartbeat_ttl_ms", "step", "staged_bytes", "reason"}],
     "counts": {"rank": {...}, "weights": {...}, "membership": {...}, "stale": int},
     "timeline": {"now_ms", "rounds": [{"round", "start_ms", "end_ms" | None, "outcome" (running | rearranged |
                 probe_mismatch | skipped | aborted: ``reasons.round_outcome``),
                  "cluster": [{"state", "start_ms", "end_ms", "deadline_ms" | None}],
                  "ranks": {ep_rank: [{"state", "start_ms", "end_ms"}]},
                  "marks": [{"kind": "abort" | "alarm" | "skip" | "start_refused" | "probe_mismatch", "ts_ms",
                             "reason", "id"}]}]},
     "plan": None | {"plan_id", "round", "policy", "live_ranks" (None: every rank), "balancedness_before",
                     "balancedness_after", "moved_experts", "before": [[GPU load / layer mean]] (L x members),
                     "after": [[...]], "lo", "hi"},
     "last_audit_id": str}

Times are ms of the Redis server's clock (a recording: its ``ts_ms``). The diagrams are
:func:`annotated_diagrams`: the generated statecharts with the DOM contract's attributes on every state and edge.
"""

from __future__ import annotations

import re
import threading
import xml.etree.ElementTree as ET
from collections import Counter, deque
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from fdeplb.errors import CorruptRecordError, DependencyError, InputError, NotFoundError
from fdeplb.machines.tables import CLUSTER, MEMBERSHIP, RANK, TABLES, WEIGHTS, ClusterState, MachineTable
from fdeplb.placement.metrics import gpu_loads
from fdeplb.recording import audit_dict
from fdeplb.replay.start_state import NOT_TRANSITIONS
from fdeplb.rounds.reasons import PROBE_MISMATCH, RoundOutcome, round_outcome
from fdeplb.status import cluster_status, commit_command

__all__ = ["AUDIT_FILTERS", "LiveReadModel", "annotated_diagrams", "audit_rows", "build_view", "deadline_of",
           "plan_view", "timeline"]

#: audit records the live read model keeps (the newest; enough for two rounds of 256 ranks)
KEEP_RECORDS = 5000
#: rounds the timeline shows: the current (or last) one and the one before
TIMELINE_ROUNDS = 2
#: the query parameters of the audit table (``/v1/ui/audit``)
AUDIT_FILTERS = ("machine", "rank", "round", "limit")
MAX_ROWS = 2000

_SVG_NS = "http://www.w3.org/2000/svg"
ET.register_namespace("", _SVG_NS)
ET.register_namespace("xlink", "http://www.w3.org/1999/xlink")


# ---- diagrams --------------------------------------------------------------------------------------------------------
def _annotate(table: MachineTable, svg: str) -> str:
    """The Graphviz SVG of ``table`` with ``data-machine`` / ``data-state`` on every state's group and
    ``data-machine`` / ``data-from`` / ``data-trigger`` / ``data-to`` on every edge's (its ``<title>`` is
    ``source->dest``, its first label line the trigger, as :func:`fdeplb.machines.diagrams.dot` writes it); the
    XML prolog dropped (it is inlined into HTML), the size left to the page. :class:`InputError` for an edge the
    table does not have (a stale diagram)."""
    root = ET.fromstring(re.sub(r"<!DOCTYPE[^>]*>", "", svg, flags=re.S).encode())
    edges = {(src.value, spec.trigger, spec.dest.value) for spec in table.transitions for src in spec.sources}
    states = {s.value for s in table.states}
    for g in root.iter(f"{{{_SVG_NS}}}g"):
        cls, title = g.get("class"), g.find(f"{{{_SVG_NS}}}title")
        name = title.text if title is not None and title.text else ""
        if cls == "node" and name in states:
            g.set("data-machine", table.name)
            g.set("data-state", name)
        elif cls == "edge" and not name.startswith("__initial"):
            src, _, dest = name.partition("->")
            label = g.find(f"{{{_SVG_NS}}}text")
            trigger = label.text.strip() if label is not None and label.text else ""
            if (src, trigger, dest) not in edges:
                raise InputError(f"{table.name} diagram has an edge {src} -{trigger}-> {dest} the table does not "
                                 f"have: regenerate it with `fdeplb statecharts`")
            g.set("data-machine", table.name)
            g.set("data-from", src)
            g.set("data-trigger", trigger)
            g.set("data-to", dest)
    root.set("class", "statechart")
    root.set("data-machine", table.name)
    root.attrib.pop("width", None)
    root.attrib.pop("height", None)
    return ET.tostring(root, encoding="unicode")


def _boxes(table: MachineTable) -> str:
    """A row of state boxes for ``table`` when no Graphviz diagram can be had (an installed wheel without ``dot``):
    the states, their codes and the DOM contract, no edges."""
    parts = []
    for i, state in enumerate(table.states):
        x = 10 + i * 150
        parts.append(f'<g class="node" data-machine="{table.name}" data-state="{state.value}">'
                     f'<rect x="{x}" y="10" width="140" height="36" rx="6" fill="#eeeeee" stroke="black"/>'
                     f'<text x="{x + 70}" y="33" text-anchor="middle" font-size="12">{state.value} '
                     f'[{table.to_code(state)}]</text></g>')
    width = 20 + 150 * len(table.states)
    return (f'<svg xmlns="{_SVG_NS}" class="statechart" data-machine="{table.name}" viewBox="0 0 {width} 56">'
            + "".join(parts) + "</svg>")


_DIAGRAMS: dict[str, str] = {}
_DIAGRAMS_LOCK = threading.Lock()


def annotated_diagrams(svg_of: Callable[[str], str]) -> dict[str, str]:
    """``{machine: inline SVG}`` for every table: ``svg_of(machine)``, the generated statechart (the API passes
    what ``/v1/statecharts/{machine}.svg`` serves), annotated by :func:`_annotate`; plain state boxes where
    ``svg_of`` raises :class:`~fdeplb.errors.DependencyError` (no diagram and no Graphviz). Computed once per
    process."""
    with _DIAGRAMS_LOCK:
        if not _DIAGRAMS:
            for name, table in TABLES.items():
                try:
                    _DIAGRAMS[name] = _annotate(table, svg_of(name))
                except DependencyError:
                    _DIAGRAMS[name] = _boxes(table)
        return dict(_DIAGRAMS)


# ---- timeline --------------------------------------------------------------------------------------------------------
def deadline_of(state: str, config) -> int | None:
    """How long the coordinator lets the cluster wait in ``state`` (ms, :class:`~fdeplb.store.Deadlines`), None
    where it sets no deadline: COLLECTING and PLANNING share ``collecting_ms``, LOAD_SUCC has ``commit_ms`` only
    on a cordoned cluster."""
    d = config.deadlines
    by_state = {ClusterState.COLLECTING: d.collecting_ms, ClusterState.PLANNING: d.collecting_ms,
                ClusterState.LOADING: d.loading_ms, ClusterState.SWAPPING: d.swapping_ms,
                ClusterState.LOAD_SUCC: d.commit_ms if config.cordoned else None}
    return by_state.get(ClusterState(state)) if state in ClusterState.__members__ else None


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def timeline(records: Sequence[Mapping[str, Any]], config, now_ms: int, rounds: int = TIMELINE_ROUNDS
             ) -> dict[str, Any]:
    """The last ``rounds`` rounds of ``records`` (audit dicts, oldest first): per round the cluster's time in each
    state with its deadline, each rank's time in each of its states, and the aborts, alarms, skips, start
    refusals and probe mismatches (the shape in the module doc). A round is the records of the cluster and rank machines carrying its
    number; it ends at the cluster's return to FREE (``end_ms`` None while it runs, drawn up to ``now_ms``)."""
    by_round: dict[int, list[Mapping[str, Any]]] = {}
    for rec in records:
        if rec.get("machine") in (CLUSTER.name, RANK.name) and _int(rec.get("round")) > 0:
            by_round.setdefault(_int(rec.get("round")), []).append(rec)
    out = []
    for n in sorted(by_round)[-rounds:]:
        recs = by_round[n]
        cluster = [r for r in recs if r.get("machine") == CLUSTER.name and r.get("trigger") not in NOT_TRANSITIONS]
        starts = [r for r in cluster if r.get("trigger") == "start"]
        if not starts:
            continue  # only the tail of a round older than the kept records
        start_ms = _int(starts[0].get("ts_ms"))
        end = next((r for r in cluster if r.get("to") == CLUSTER.initial.value), None)
        end_ms = _int(end.get("ts_ms")) if end is not None else None
        segments = []
        for i, rec in enumerate(cluster):
            if rec.get("to") == CLUSTER.initial.value:
                break
            seg_end = _int(cluster[i + 1].get("ts_ms")) if i + 1 < len(cluster) else None
            limit = deadline_of(str(rec.get("to")), config)
            segments.append({"state": rec.get("to"), "start_ms": _int(rec.get("ts_ms")), "end_ms": seg_end,
                             "deadline_ms": _int(rec.get("ts_ms")) + limit if limit else None})
        lanes: dict[int, list[dict[str, Any]]] = {}
        for rec in recs:
            if rec.get("machine") != RANK.name or rec.get("trigger") in NOT_TRANSITIONS:  # a takeover note
                continue
            r = _int(str(rec.get("key", "")).partition(":")[2], -1)
            lane = lanes.setdefault(r, [])
            ts = _int(rec.get("ts_ms"))
            if lane and lane[-1]["end_ms"] is None:
                lane[-1]["end_ms"] = ts
            if rec.get("to") != RANK.initial.value:
                lane.append({"state": rec.get("to"), "start_ms": ts, "end_ms": None})
        marks = [{"kind": _mark_kind(r), "ts_ms": _int(r.get("ts_ms")),
                  "reason": r.get("reason", ""), "id": r.get("id", "")}
                 for r in records if r.get("machine") == CLUSTER.name
                 and (r.get("trigger") in NOT_TRANSITIONS or r.get("trigger") == "abort" or _probe_failed(r))
                 and start_ms <= _int(r.get("ts_ms")) <= (end_ms if end_ms is not None else now_ms)]
        of = {str(r.get("trigger")): r for r in cluster}  # its swapped and load: a probe mismatch, its rollback
        outcome = round_outcome(end if end is not None else cluster[-1], of.get("swapped"), of.get("load"))[0].value
        out.append({"round": n, "start_ms": start_ms, "end_ms": end_ms, "outcome": outcome, "cluster": segments,
                    "ranks": {str(r): lane for r, lane in sorted(lanes.items()) if r >= 0}, "marks": marks})
    return {"now_ms": now_ms, "rounds": out}


def _mark_kind(record: Mapping[str, Any]) -> str:
    """A timeline mark's kind: its trigger, and ``skip`` for a gated round's abort (a normal outcome, not a failure:
    :func:`~fdeplb.rounds.reasons.round_outcome`)."""
    if record.get("trigger") == "abort" and str(record.get("to")) == CLUSTER.initial.value:
        return "skip" if round_outcome(record)[0] is RoundOutcome.SKIPPED else "abort"
    return "probe_mismatch" if _probe_failed(record) else str(record.get("trigger"))


def _probe_failed(record: Mapping[str, Any]) -> bool:
    """A cluster ``swapped`` after which some rank's output probe failed (a mark: the round is rolled back)."""
    return record.get("trigger") == "swapped" and str(record.get("reason", "")).startswith(PROBE_MISMATCH)


# ---- audit table -----------------------------------------------------------------------------------------------------
def _filter_int(value: str | None, name: str, hi: int) -> int | None:
    if value in (None, ""):
        return None
    if not re.fullmatch(r"[0-9]{1,9}", value):
        raise InputError(f"{name} must be an integer in [0, {hi}], got {value[:40]!r}")
    n = int(value)
    if n > hi:
        raise InputError(f"{name} must be an integer in [0, {hi}], got {n}")
    return n


def audit_rows(records: Sequence[Mapping[str, Any]], machine: str | None = None, rank: str | None = None,
               round_: str | None = None, limit: str | None = None) -> list[Mapping[str, Any]]:
    """The audit table: ``records`` (audit dicts) of ``machine`` (a table name), of rank ``rank`` (its rank,
    weight-status and membership records) and of round ``round_``, the newest ``limit`` (default and at most
    :data:`MAX_ROWS`), oldest first. Parameters are query text, checked here: :class:`InputError` (400) for an
    unknown machine or a value that is not a decimal in range."""
    if machine not in (None, "") and machine not in TABLES:
        raise InputError(f"machine must be one of {', '.join(TABLES)}, got {machine[:40]!r}")
    r = _filter_int(rank, "rank", 1 << 20)
    n = _filter_int(round_, "round", 1 << 40)
    count = _filter_int(limit, "limit", MAX_ROWS) or MAX_ROWS
    out = []
    for rec in records:
        if machine and rec.get("machine") != machine:
            continue
        if r is not None and str(rec.get("key", "")).partition(":")[2] != str(r):
            continue
        if n is not None and _int(rec.get("round"), -1) != n:
            continue
        out.append(rec)
    return out[-count:]


# ---- plan ------------------------------------------------------------------------------------------------------------
def _relative(loads: np.ndarray) -> np.ndarray:
    mean = loads.mean(axis=1, keepdims=True)
    return np.divide(loads, mean, out=np.ones_like(loads, dtype=float), where=mean > 0)


def plan_view(plan, ep_size: int) -> dict[str, Any] | None:
    """The last plan as the page draws it: per-GPU load before / after (:func:`fdeplb.placement.gpu_loads` of its
    snapshot under the old and the new phy2log, as ``rebalance --plot`` draws them: each layer's GPU loads over
    their mean, rounded to 4 decimals), the colour scale's ``lo`` / ``hi``, balancedness and moved experts. None
    for no plan. Like its balancedness, the loads are over the plan's members (``PlanEntry.live_ranks``): only
    their GPUs are drawn, and ``live_ranks`` names them when some rank is not a member (else None)."""
    if plan is None:
        return None
    members = list(plan.live_ranks(ep_size))
    before = _relative(gpu_loads(plan.expert_load, plan.old_phy2log, ep_size, members)[:, members])
    after = _relative(gpu_loads(plan.expert_load, plan.new_phy2log, ep_size, members)[:, members])
    return {"plan_id": plan.plan_id, "round": plan.round, "policy": plan.policy,
            "live_ranks": None if len(members) == ep_size else members,
            "balancedness_before": plan.balancedness_before, "balancedness_after": plan.balancedness_after,
            "moved_experts": plan.moved_experts, "before": np.round(before, 4).tolist(),
            "after": np.round(after, 4).tolist(), "lo": round(min(0.95, float(before.min()), float(after.min())), 4),
            "hi": round(max(1.05, float(before.max()), float(after.max())), 4)}


# ---- the view ----------------------------------------------------------------------------------------------------
def _last_transitions(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    last: dict[str, Any] = dict.fromkeys(TABLES)
    for rec in records:
        if rec.get("trigger") not in NOT_TRANSITIONS and rec.get("machine") in TABLES:
            last[str(rec["machine"])] = {k: rec.get(k) for k in ("id", "from", "to", "trigger", "key")}
    return last


def waiting_view(summary: Mapping[str, Any], cluster: str, redis_url: str, plan=None) -> dict[str, Any] | None:
    """What a cordoned cluster's LOAD_SUCC round waits for (the ``waiting`` part of the view dict): its plan, the
    command that commits it (:func:`fdeplb.status.commit_command` with ``redis_url``), how long until its
    ``commit_ms`` deadline aborts it, and the plan's figures when ``plan`` (a :class:`~fdeplb.store.PlanEntry`) is
    that plan. None unless ``summary`` is cordoned and in LOAD_SUCC with a plan."""
    plan_id = summary.get("plan_id")
    if not (summary.get("cordoned") and summary.get("state") == ClusterState.LOAD_SUCC.value and plan_id):
        return None
    mine = plan is not None and plan.plan_id == plan_id
    figures = {k: getattr(plan, k) if mine else None for k in ("balancedness_before", "balancedness_after",
                                                               "moved_experts")}
    left = summary.get("deadline_left_ms")
    text = ("The cluster is cordoned: every rank has staged the plan" + (
        f" (balancedness {figures['balancedness_before']:.4f} -> {figures['balancedness_after']:.4f}, "
        f"{figures['moved_experts']} experts move)" if mine else "") +
        " and nothing is swapped until an operator commits it." + (
        "" if left is None else f" Not committed within {_seconds(left)}, the round aborts." if left >= 0 else
        f" Its commit deadline passed {_seconds(-left)} ago.") + " Commit it with:")
    return {"plan_id": plan_id, "round": summary.get("round"), "deadline_left_ms": left, **figures,
            "title": f"Waiting for an operator's commit: round {summary.get('round')}, plan {plan_id}",
            "text": text, "command": commit_command(redis_url, cluster, plan_id),
            "also": "or over HTTP: POST /rearrange_experts {\"action\": \"update_weight_from_tensor\"} to "
                    "`fdeplb serve`. `fdeplb round abort` drops the round instead."}


def _seconds(ms: int) -> str:
    return f"{ms / 1000:.0f} s" if ms >= 10_000 else f"{ms / 1000:.1f} s"


def build_view(*, mode: str, cluster: str, summary: Mapping[str, Any], ranks: Sequence[Mapping[str, Any]],
               records: Sequence[Mapping[str, Any]], config, now_ms: int, plan=None, redis_url: str = "URL"
               ) -> dict[str, Any]:
    """The view dict (module doc) from its parts: ``summary`` the cluster's fields (``state`` None: Redis holds no
    records of it), ``ranks`` one row per rank (``state``, ``weights``, ``membership``, ``stale`` ...),
    ``records`` the audit dicts known (oldest first), ``plan`` the last :class:`~fdeplb.store.PlanEntry` or None,
    ``redis_url`` as the commit command names it (no password)."""
    counts = {RANK.name: Counter(str(r["state"]) for r in ranks),
              WEIGHTS.name: Counter(str(r["weights"]) for r in ranks),
              MEMBERSHIP.name: Counter(str(r["membership"]) for r in ranks)}
    held = {} if summary["state"] is None else {str(summary["state"]): 1}
    current = {CLUSTER.name: held, **{k: dict(v) for k, v in counts.items()}}
    return {
        "mode": mode, "cluster": cluster, "redis": "ok", "now_ms": now_ms,
        "summary": dict(summary),
        "waiting": waiting_view(summary, cluster, redis_url, plan),
        "gone": None, "recreated": None,
        "states": {name: [s.value for s in table.states] for name, table in TABLES.items()},
        "current": current,
        "last": _last_transitions(records),
        "ranks": [dict(r) for r in ranks],
        "counts": {**{k: dict(v) for k, v in counts.items()}, "stale": sum(1 for r in ranks if r.get("stale"))},
        "timeline": timeline(records, config, now_ms),
        "plan": plan_view(plan, config.ep_size) if plan is not None else None,
        "last_audit_id": str(records[-1].get("id", "")) if records else "",
    }


def _text(value: Any) -> Any:
    """A state enum as its name (JSON), anything else as it is."""
    return getattr(value, "value", value)


class LiveReadModel:
    """The UI's read model of one live cluster: :func:`fdeplb.status.cluster_status` plus the newest
    :data:`KEEP_RECORDS` audit records (read once, then only the new ones) and the last plan (read when its id
    changes). Thread-safe; one per app, shared by every page."""

    def __init__(self, store, keep: int = KEEP_RECORDS) -> None:
        self.store = store
        self._records: deque[dict[str, Any]] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._plan: tuple[str, Any] = ("", None)
        self._incarnation = ""  # of the cluster last seen
        self._last_seen: dict[str, Any] | None = None  # its summary then (state, round, version, plan_id, at_ms)
        self._lost: dict[str, Any] | None = None  # the last seen summary of the records that were lost

    def _refresh(self) -> list[dict[str, Any]]:
        """The kept audit records, after reading those appended since the last call (all kept ones again when the
        stream was trimmed or recreated under them)."""
        last = self._records[-1]["id"] if self._records else None
        fresh = self.store.audit(f"({last}", "+") if last else self.store.recent_audit(self._records.maxlen)
        if last and not fresh and self.store.last_audit_id() < last:  # a stream rebuilt from scratch
            self._records.clear()
            fresh = self.store.recent_audit(self._records.maxlen)
        self._records.extend(audit_dict(e) for e in fresh)
        return list(self._records)

    def _last_plan(self, plan_id: str):
        if not plan_id:
            return None
        if self._plan[0] != plan_id:
            self._plan = (plan_id, self.store.read_plan(plan_id))
        return self._plan[1]

    def records(self) -> list[dict[str, Any]]:
        """The kept audit records (audit dicts, oldest first), refreshed."""
        with self._lock:
            return self._refresh()

    def view(self) -> dict[str, Any]:
        """The view dict of the cluster now (module doc); with ``gone`` when Redis holds no records of it, and
        ``recreated`` when it was created anew since last seen. Store errors as the store raises them (Redis
        unavailable: :class:`~fdeplb.errors.RedisUnavailableError`)."""
        try:
            status = cluster_status(self.store)
        except NotFoundError:
            return self._gone_view()
        view = self._view(status)
        incarnation = self.store.read_config().incarnation  # as cluster_status read it, fresh
        summary = view["summary"]
        with self._lock:
            if self._incarnation and incarnation and incarnation != self._incarnation:
                self._lost = self._last_seen  # its records were lost (and maybe seen gone) in between
            self._incarnation = incarnation or self._incarnation
            self._last_seen = {k: summary.get(k) for k in ("state", "round", "version", "plan_id")} | {
                "at_ms": view["now_ms"]}
            if self._lost is not None and summary.get("round") == 0:
                view["recreated"] = {"last_seen": self._lost, "title": "Records lost, cluster created anew",
                                     "text": (
                    f"Cluster {self.store.cluster} was created anew: its records were lost or deleted (last seen "
                    f"{_seen(self._lost)}) and it was initialised again. Its rounds and audit before are gone; "
                    f"rounds count from 1 again.")}
            elif summary.get("round"):
                self._lost = None
        return view

    def _gone_view(self) -> dict[str, Any]:
        """The view when Redis holds no records of the cluster (no configuration): ``gone`` says so plainly, with
        what was last seen of it and what to run; every other part is empty."""
        now = self.store.now_ms()
        with self._lock:
            self._records.clear()
            self._lost = last = self._lost or self._last_seen
            self._plan = ("", None)
        cluster = self.store.cluster
        text = (f"Redis holds no records of cluster {cluster}: " + (
            f"they were lost (Redis restarted empty or was flushed) or the cluster was deleted; last seen "
            f"{_seen(last)}. " if last else
            "it was never initialised on this Redis, or its records were lost or deleted. ") +
            "Running ranks keep serving the placement they hold. Run `fdeplb init-cluster` with the cluster's "
            "arguments to create it again (it adopts the placement the live ranks report).")
        summary = dict.fromkeys(("state", "round", "plan_id", "deadline_left_ms", "reason", "alarm", "version",
                                 "generation", "lease_holder", "placement_plan_id"))
        view = build_view(mode="live", cluster=cluster, summary={**summary, "cordoned": False}, ranks=[],
                          records=[], config=None, now_ms=now)
        view["gone"] = {"title": "No records of this cluster in Redis", "text": text, "last_seen": last}
        return view

    def _view(self, status: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            records = self._refresh()
            rearrange = status["rearrange"]
            plan_id = rearrange.get("plan_id") or status["placement"].get("plan_id") or ""
            try:
                plan = self._last_plan(plan_id)
            except (NotFoundError, CorruptRecordError):  # pruned or unreadable: the page shows no plan
                plan = None
        summary = {k: _text(rearrange.get(k)) for k in ("state", "round", "plan_id", "deadline_left_ms", "reason",
                                                        "alarm", "version")}
        summary.update(generation=status["generation"], lease_holder=rearrange.get("lease_holder"),
                       placement_plan_id=status["placement"].get("plan_id"), cordoned=status["config"]["cordoned"])
        ranks = [{"ep_rank": r["ep_rank"], "state": _text(r["state"]), "weights": _text(r["weights"]),
                  "membership": _text(r["membership"]), "stale": bool(r["stale"]),
                  "registered": r["registered"], "heartbeat_age_ms": r["heartbeat_age_ms"],
                  "heartbeat_ttl_ms": r["heartbeat_ttl_ms"], "step": r.get("step"),
                  "staged_bytes": r.get("staged_bytes"), "reason": r["reason"], "routing": r["routing"]}
                 for r in status["ranks"]]
        return build_view(mode="live", cluster=status["cluster"], summary=summary, ranks=ranks, records=records,
                          config=self.store.read_config(), now_ms=status["now_ms"], plan=plan,
                          redis_url=_without_password(self.store.url))

    def audit(self, **filters: str | None) -> list[dict[str, Any]]:
        """:func:`audit_rows` over the kept records (``machine``, ``rank``, ``round_``, ``limit``)."""
        return audit_rows(self.records(), **filters)


def _seen(last: Mapping[str, Any]) -> str:
    """What was last seen of a cluster, in words."""
    return f"in round {last.get('round')}, {last.get('state')} v{last.get('version')}"


def _without_password(url: str) -> str:
    """``url`` with the password of its user part left out (the page shows it in the commit command)."""
    return re.sub(r"//([^/@:]*):[^/@]*@", lambda m: f"//{m[1]}@" if m[1] else "//", url)
