"""The audited reasons whose contents a replay checks, as structured detail with the text derived from it.

The coordinator writes each of these as an audit record whose ``detail`` field is canonical JSON (chained like
every other field, see ``store/lua/_chain.lua``) and whose ``reason`` is the text :class:`Reason` derives from that
detail; :mod:`fdeplb.replay` reads the structure back (never the prose):

- a start refused for stale ranks (trigger ``start_refused``, a note): ``{"stale_ranks": [{"ep_rank": 2,
  "heartbeat_age_ms": 2412}, ...]}``;
- the start that follows it: every registered rank's heartbeat, ``{"heartbeats": [{"ep_rank": 0, "age_ms": 12,
  "ttl_ms": 2000}, ...]}`` (ttl 0: none);
- a gated round (trigger ``abort`` when skipped, ``load`` when it goes on): ``{"gate": {"balancedness_before",
  "balancedness_after", "gain", "min_gain", "moved_experts"}}`` and ``live_ranks`` when some rank is not a member
  (:meth:`fdeplb.rounds.gating.GateDecision.detail`, full float precision, over the round's members);
- the commit of a cordoned cluster (trigger ``commit``): ``{"requested_by": "http"}``;
- the load of a re-placement round (trigger ``load``): ``{"replacement": {"ranks": [3], "orphans": [[layer,
  log_id], ...]}}`` (the ranks that are not members, the experts that had no replica on a member);
- a re-placement that fails closed (trigger ``abort``, and its ``alarm``): ``{"ranks": [3], "orphans": [...]}``;
- a weight clear / update withdrawn because its switch step was not fixed in time (trigger ``weights_cancelled``,
  a note): ``{"ranks": [3], "request": 7, "action": "clear", "weights_ms": 120000}`` (the ranks that never armed);
- a rank's weight-status ``clear`` / ``update`` and its ``cancel`` / ``cancel_to_cleared``: ``{"request": 7}``, the
  weight request it carries out or gives up;
- a round request that expired unstarted (trigger ``request_expired``, a note): ``{"round": 5, "age_ms": 30012,
  "request_ttl_ms": 30000, "waited_on": "start refused: stale ranks 3 (...)"}``; one an operator cancelled
  (``request_cancelled``) and an operator's abort (``operator_abort``): ``{"by": "operator:me@host", ...}``
  (:mod:`fdeplb.orchestration.operator`).

- a committed swap whose output probe failed on some rank (trigger ``swapped``): ``{"probe_mismatch": [{"ep_rank":
  1, "outcome": "mismatch", "layers": [3], "message": "..."}, ...]}`` (:func:`probe_mismatch`);
- the ``load`` of a round to a supplied placement: a rollback, ``{"supplied": {"kind": "rollback", "undoes": 5,
  "plan_id": "<the placement it goes back to>"}}``, or an operator's plan (``rearrange --plan FILE``),
  ``{"supplied": {"kind": "operator", "undoes": <the last round as it was supplied>, "plan_id": "<routing digest
  of the plan>", "why": "FILE"}}``
  (:func:`supplied_round`).

Recordings written before the detail field existed (schema 1) carry the numbers in the text only: the readers
(:func:`stale_ranks`, :func:`heartbeats`, :func:`requested_by`) fall back to parsing the text for those.

Also the one round-outcome rule (:func:`round_outcome`). Pure functions, no I/O. Ages and TTLs are milliseconds
(Redis server clock).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

import numpy as np

from fdeplb.checks import check_int
from fdeplb.errors import InputError
from fdeplb.machines.tables import ClusterState
from fdeplb.placement import TOLERANCE
from fdeplb.rounds.gating import GateDecision
from fdeplb.store.liveness import NOT_REGISTERED

#: reason of a ``start_refused`` note: ``start refused: stale ranks 2 (heartbeat 2412 ms ago), 3 (...)``
REFUSED = "start refused: stale ranks "
#: reason of the start after a refusal: ``start after a refusal: heartbeats 0 12 ms ago (ttl 2000 ms), 1 ...``
FRESH = "start after a refusal: heartbeats "
#: reason of a gated round's abort
GATED = "gated: skipped: "
#: reason of a cordoned cluster's commit: ``external commit requested by http``
EXTERNAL = "external commit requested by "
#: reason of a re-placement that cannot give every expert a replica on a member (its abort and alarm)
FAIL_CLOSED = "fail closed: "

_STALE_ITEM = re.compile(r"(\d+) \(heartbeat (-?\d+) ms ago\)")
_FRESH_ITEM = re.compile(r"(\d+) (-?\d+) ms ago \((?:ttl (\d+) ms|no ttl)\)")


@dataclass(frozen=True)
class Reason:
    """An audited reason: ``detail`` (JSON-able, the facts) and ``text`` (what a person reads, derived from it)."""

    text: str
    detail: dict[str, Any] = field(default_factory=dict)


def detail_of(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``detail`` of an audit record (its fields as text) as an object; None when it has none (a record of a
    schema 1 recording, or one whose reason carries no facts).

    Raises :class:`ValueError` when the field is there but is not a JSON object (a corrupt or forged record)."""
    text = _field(record, "detail")
    if not text:
        return None
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"detail is not a JSON object: {str(text)[:80]!r}")
    return value


# ---- a refused start and the start after it ------------------------------------------------------------------------
def refusal(stale: Mapping[int, int]) -> Reason:
    """The ``start_refused`` reason for ``stale`` (ep_rank -> ms since its heartbeat, or
    :data:`~fdeplb.store.liveness.NOT_REGISTERED` for a rank with no registered agent), ranks in order."""
    items = [{"ep_rank": int(r), "heartbeat_age_ms": int(age)} for r, age in sorted(stale.items())]
    text = REFUSED + ", ".join(f"{i['ep_rank']} (not registered)" if i["heartbeat_age_ms"] == NOT_REGISTERED
                               else f"{i['ep_rank']} (heartbeat {i['heartbeat_age_ms']} ms ago)" for i in items)
    return Reason(text, {"stale_ranks": items})


def stale_ranks(record: Mapping[str, Any]) -> dict[int, int] | None:
    """ep_rank -> ms since its heartbeat, of a ``start_refused`` record; None if it names none.
    Reads ``detail`` (schema 2), else the text of :func:`refusal` (schema 1). ValueError for a corrupt detail,
    :class:`~fdeplb.errors.InputError` for a value that is not an integer (:func:`~fdeplb.checks.check_int`)."""
    detail = detail_of(record)
    if detail is not None:
        return {_rank(i): check_int(i["heartbeat_age_ms"], "heartbeat_age_ms")
                for i in detail.get("stale_ranks", [])} or None
    return _items(_field(record, "reason"), REFUSED, _STALE_ITEM, lambda m: int(m[2]))


def fresh(beats: Mapping[int, tuple[int, int]]) -> Reason:
    """The reason of a start that follows a refusal: every registered rank's (ms since its heartbeat, TTL ms;
    TTL 0 = none) as :meth:`fdeplb.store.Store.heartbeats` read them, ranks in order."""
    items = [{"ep_rank": int(r), "age_ms": int(age), "ttl_ms": int(ttl)} for r, (age, ttl) in sorted(beats.items())]
    text = FRESH + ", ".join(f"{r} {age} ms ago ({f'ttl {ttl} ms' if ttl > 0 else 'no ttl'})"
                             for r, (age, ttl) in sorted(beats.items()))
    return Reason(text, {"heartbeats": items})


def heartbeats(record: Mapping[str, Any]) -> dict[int, tuple[int, int]] | None:
    """ep_rank -> (ms since its heartbeat, TTL ms) of a start record after a refusal; None if it has none.
    Reads ``detail`` (schema 2), else the text of :func:`fresh` (schema 1). ValueError for a corrupt detail,
    :class:`~fdeplb.errors.InputError` for a value that is not an integer (:func:`~fdeplb.checks.check_int`)."""
    detail = detail_of(record)
    if detail is not None:
        return {_rank(i): (check_int(i["age_ms"], "age_ms"),
                           check_int(i["ttl_ms"], "ttl_ms", lo=0))
                for i in detail.get("heartbeats", [])} or None
    return _items(_field(record, "reason"), FRESH, _FRESH_ITEM, lambda m: (int(m[2]), int(m[3] or 0)))


# ---- the gain gate ----------------------------------------------------------------------------------------------
def skipped(decision: GateDecision) -> Reason | None:
    """Why the gate skips a plan (:class:`fdeplb.rounds.gating.GateDecision`): ``skipped:`` and
    :attr:`~fdeplb.rounds.gating.GateDecision.why_skipped` with the numbers (4 decimals in the text, full
    precision in the detail); None when the round goes on. The periodic trigger's skip note says this."""
    why = decision.why_skipped
    if why is None:
        return None
    text = (f"skipped: {why} (balancedness {decision.balancedness_before:.4f} -> "
            f"{decision.balancedness_after:.4f}{_over(decision)}, {decision.moved_experts} moved experts)")
    return Reason(text, {"gate": decision.detail()})


def _over(decision: "GateDecision") -> str:
    """Where the figures are over, in a gate's text: nothing with every rank a member."""
    return "" if decision.live_ranks is None else f" over members {list(decision.live_ranks)}"


def gate_passed(decision: "GateDecision") -> Reason:
    """The ``load`` reason of a round the gate lets through: its figures (as :func:`skipped`'s) and the rule."""
    if decision.gain > decision.min_gain:
        rule = f"gain {decision.gain:.4f} > min_gain {decision.min_gain}"
    else:  # GateDecision.for_locality; a gain at or above 0 (below min_gain) gives up nothing, never "-0.0003"
        given_up = -decision.gain if decision.gain < 0 else 0.0
        rule = (f"cross-node fraction {decision.cross_node_before:.4f} -> {decision.cross_node_after:.4f} (lower by "
                f"more than min_gain {decision.min_gain}), balancedness given up {given_up:.4f} <= {TOLERANCE}")
    text = (f"gate: balancedness {decision.balancedness_before:.4f} -> {decision.balancedness_after:.4f}"
            f"{_over(decision)}, {rule}, {decision.moved_experts} moved experts")
    return Reason(text, {"gate": decision.detail()})


def gated(decision: GateDecision) -> Reason | None:
    """The abort reason of a round the gate skips: :func:`skipped` after ``gated:``; None when it goes on."""
    skip = skipped(decision)
    return None if skip is None else Reason(f"gated: {skip.text}", skip.detail)


def gate(before: float, after: float, moved: int, min_gain: float) -> str | None:
    """The text of :func:`gated` for bare figures: mean balancedness ``before`` / ``after``, ``moved`` experts,
    ``min_gain``; None when the round goes on."""
    reason = gated(GateDecision(np.empty((0, 0), dtype=np.int64), before, after, moved, min_gain))
    return None if reason is None else reason.text


def gate_figures(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """The gate's figures of a gated abort record (``detail.gate``); None for a record without them (schema 1:
    the replay then compares the text). ValueError for a corrupt detail."""
    figures = (detail_of(record) or {}).get("gate")
    return dict(figures) if isinstance(figures, dict) else None


# ---- a cordoned cluster's commit --------------------------------------------------------------------------------
def external_commit(by: str) -> Reason:
    """The reason of a cordoned cluster's commit, naming who requested it (``""``: an older request, unnamed)."""
    who = by or "operator"
    return Reason(EXTERNAL + who, {"requested_by": who})


def requested_by(record: Mapping[str, Any]) -> str | None:
    """Who requested a commit record's external commit; None if it was not one. ValueError for a corrupt detail."""
    detail = detail_of(record)
    if detail is not None:
        return str(detail["requested_by"]) if "requested_by" in detail else None
    reason = _field(record, "reason")
    return reason.removeprefix(EXTERNAL) if reason.startswith(EXTERNAL) else None


# ---- a lost rank's experts re-placed, or not ------------------------------------------------------------------
def _orphan_list(orphans) -> list[list[int]]:
    return [[int(l), int(e)] for l, e in orphans]


def replacement_round(lost: list[int], orphans) -> Reason:
    """The reason of a re-placement round's ``load``: the ``orphans`` ((layer, log_id) pairs) that had no replica on
    a member once ``lost`` ranks left get one on a live rank; nothing else moves."""
    items = _orphan_list(orphans)
    text = (f"re-placement: {len(items)} orphaned experts of ranks {sorted(lost)} get a live replica, nothing else "
            f"moves" if items else f"re-placement: ranks {sorted(lost)} leave the routes; every expert keeps a live "
            f"replica, nothing moves")
    return Reason(text, {"replacement": {"ranks": sorted(int(r) for r in lost), "orphans": items}})


def fail_closed(error: str, lost: list[int], orphans) -> Reason:
    """The reason of a re-placement that fails closed (``error``: the :class:`~fdeplb.errors.RedundancyError`'s
    text naming the experts): no placement that drops an expert is committed."""
    return Reason(f"{FAIL_CLOSED}{error}", {"ranks": sorted(int(r) for r in lost), "orphans": _orphan_list(orphans)})


def is_replacement(record: Mapping[str, Any]) -> bool:
    """Whether an audit record is the ``load`` of a re-placement round. ValueError for a corrupt detail."""
    return _field(record, "trigger") == "load" and "replacement" in (detail_of(record) or {})


def failed_closed(record: Mapping[str, Any]) -> bool:
    """Whether an audit record is the abort of a re-placement that failed closed."""
    return _field(record, "trigger") == "abort" and _field(record, "reason").startswith(FAIL_CLOSED)


# ---- a weight request nobody could switch ----------------------------------------------------------------------
def weights_cancelled(action: str, request: int, ranks: list[int], weights_ms: int) -> Reason:
    """The reason of withdrawing weight request ``request`` (``action`` clear / update) whose switch step was not
    fixed ``weights_ms`` after it was requested, held back by ``ranks`` (their workers never armed for it)."""
    held = sorted(int(r) for r in ranks)
    text = (f"weight {action} {request} cancelled: not switched {weights_ms} ms after it was requested; the "
            f"workers of ranks {held} never reached a safe point armed for it (they must call at_safe_point); "
            f"no rank applied it, every rank returns to its previous weight state")
    return Reason(text, {"ranks": held, "request": int(request), "action": action, "weights_ms": int(weights_ms)})


def weight_request(request: int) -> dict[str, Any]:
    """The ``detail`` of a weight-status ``clear`` / ``update`` record: the cluster's weight request it carries out
    (its reason is the operator's, as requested). A replay knows from it which request each rank applied."""
    return {"request": int(request)}


def request_cancelled(request: int) -> Reason:
    """The reason of a weight-status ``cancel`` / ``cancel_to_cleared``: weight request ``request`` was withdrawn
    (:func:`weights_cancelled`) before this rank applied it."""
    return Reason(f"weight request {int(request)} cancelled", {"request": int(request)})


def request_of(record: Mapping[str, Any]) -> int | None:
    """The weight request a ``clear`` / ``update`` / cancel / ``weights_cancelled`` record names (``detail.request``);
    None if it names none (a record written before it was recorded). ValueError for a corrupt detail,
    :class:`~fdeplb.errors.InputError` for a request that is not an integer >= 1."""
    detail = detail_of(record) or {}
    return None if "request" not in detail else check_int(detail["request"], "request", lo=1)


def held_back(record: Mapping[str, Any]) -> list[int] | None:
    """The ranks a ``weights_cancelled`` record names as having held the request back; None if it names none.
    ValueError for a corrupt detail."""
    ranks = (detail_of(record) or {}).get("ranks")
    return [int(r) for r in ranks] if isinstance(ranks, list) else None


# ---- a round request nobody started -----------------------------------------------------------------------------
def request_expired(round_: int, age_ms: int, ttl_ms: int, waited_on: str) -> Reason:
    """The reason of withdrawing round ``round_``'s request, pending ``age_ms`` past its ``ttl_ms``
    (``deadlines.request_ttl_ms``); ``waited_on``: why it did not start ("" when nothing was recorded)."""
    text = (f"round {round_} request expired: not started {age_ms} ms after it was requested (request_ttl_ms "
            f"{ttl_ms})" + (f"; it waited on: {waited_on}" if waited_on else ""))
    return Reason(text, {"round": int(round_), "age_ms": int(age_ms), "request_ttl_ms": int(ttl_ms),
                         "waited_on": waited_on})


# ---- a swap checked by its output, and the round back ------------------------------------------------------------
#: reason of a ``swapped`` whose probe failed on some rank: ``probe_mismatch: rank 1 layers [3] (...)``
PROBE_MISMATCH = "probe_mismatch: "
#: the kinds of supplied placement a round may go to (:func:`supplied_round`)
SUPPLIED_KINDS = ("rollback", "operator")


def probe_mismatch(ranks: list[dict[str, Any]]) -> Reason:
    """The reason of a ``swapped`` after which some rank's output probe failed: ``ranks`` as ``[{"ep_rank",
    "outcome" ("mismatch" / "failed"), "layers" [ints], "message"}]`` (from their rank records; messages cut to
    200 characters), rank order. The round is past its commit point: it rolls forward, and the coordinator goes
    back to the previous placement (:func:`supplied_round`)."""
    items = [{"ep_rank": int(i["ep_rank"]), "outcome": str(i["outcome"]), "layers": [int(x) for x in i["layers"]],
              "message": str(i["message"])[:200]} for i in sorted(ranks, key=lambda i: int(i["ep_rank"]))]
    text = PROBE_MISMATCH + "; ".join(
        f"rank {i['ep_rank']} " + (f"layers {i['layers']}" if i["layers"] else i["outcome"]) + f" ({i['message']})"
        for i in items)
    return Reason(text, {"probe_mismatch": items})


def probe_mismatches(record: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The ranks a ``swapped`` record names as having failed their probe (:func:`probe_mismatch`'s items); None
    when it names none. ValueError for a corrupt detail, :class:`~fdeplb.errors.InputError` for a rank or layer
    that is not an integer >= 0."""
    items = (detail_of(record) or {}).get("probe_mismatch")
    if items is None:
        return None
    if not isinstance(items, list):
        raise ValueError("probe_mismatch is not a list")
    return [{"ep_rank": _rank(i), "outcome": str(i["outcome"]),
             "layers": [check_int(x, "layer", lo=0) for x in i["layers"]], "message": str(i["message"])}
            for i in items]


def supplied_round(kind: str, undoes: int, plan_id: str, why: str = "") -> Reason:
    """The reason of the ``load`` of a round whose plan was supplied rather than computed (no gain gate): ``kind``
    (:data:`SUPPLIED_KINDS`; a ``rollback`` goes back to the placement ``plan_id`` round ``undoes`` replaced,
    ``""`` = the initial one; an ``operator`` plan goes to the placement whose routing digest
    (:func:`fdeplb.placement.digest.routing_digest`) is ``plan_id``, supplied after round ``undoes``, whose
    placement it replaces: the round after it is the one that tries it), ``why`` (what called for it: the
    rollback's cause, the operator's plan file)."""
    if kind not in SUPPLIED_KINDS:
        raise InputError(f"supplied placement kind must be one of {SUPPLIED_KINDS}, got {kind!r}")
    if kind == "operator":
        text = f"operator: plan {plan_id} supplied" + (f" from {why}" if why else "")
    else:
        text = (f"{kind}: round {int(undoes)} undone, back to placement {plan_id or 'initial'}"
                + (f" ({why})" if why else ""))
    return Reason(text, {"supplied": {"kind": kind, "undoes": int(undoes), "plan_id": plan_id, "why": why}})


def supplied_of(record_or_topology: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``supplied`` facts of a ``load`` record (its detail) or of a stored plan's topology; None when the
    round planned itself. ValueError for a corrupt detail or facts of the wrong shape."""
    source = record_or_topology if "supplied" in record_or_topology else (
        detail_of(record_or_topology) or {} if "detail" in record_or_topology else {})
    facts = source.get("supplied")
    if facts is None:
        return None
    if not isinstance(facts, dict) or facts.get("kind") not in SUPPLIED_KINDS:
        raise ValueError(f"supplied is not a supplied placement's facts: {str(facts)[:80]!r}")
    lo = 0 if facts["kind"] == "operator" else 1  # an operator's plan on a cluster that never had a round: 0
    return {"kind": facts["kind"], "undoes": check_int(facts["undoes"], "undoes", lo=lo),
            "plan_id": str(facts.get("plan_id", "")), "why": str(facts.get("why", ""))}


# ---- a round's outcome ------------------------------------------------------------------------------------------
class RoundOutcome(str, Enum):
    """How a round ended, as :func:`round_outcome` reads it from the round's last cluster audit record."""

    RUNNING = "running"        # not back to FREE yet
    REARRANGED = "rearranged"  # DONE -> FREE: the plan was committed and swapped everywhere
    SKIPPED = "skipped"        # a gated abort: nothing worth moving (a normal outcome, with its numbers)
    ABORTED = "aborted"        # any other abort: the old placement stayed active
    PROBE_MISMATCH = "probe_mismatch"  # swapped everywhere, but some rank's output probe failed: rolled back


def round_outcome(last: Mapping[str, Any] | None, swapped: Mapping[str, Any] | None = None,
                  load: Mapping[str, Any] | None = None) -> tuple[RoundOutcome, str]:
    """The one rule for a round's outcome: (outcome, reason) from its last cluster audit record (a mapping with
    ``from``, ``to``, ``trigger``, ``reason``; None: nothing recorded, an abort) and, when the caller has them, the
    round's ``swapped`` and ``load`` records. The reason of a skip is the gate's text without its ``gated:
    skipped:`` prefix. A round back from DONE whose ``swapped`` is a :func:`probe_mismatch` is
    :attr:`RoundOutcome.PROBE_MISMATCH`, its reason the mismatch's text without its ``probe_mismatch:`` prefix (ranks,
    layers) and its rollback (:func:`rolled_back`); without ``swapped`` it reads as rearranged."""
    if last is None:
        return RoundOutcome.ABORTED, "no cluster transition recorded"
    if last["to"] != ClusterState.FREE:
        return RoundOutcome.RUNNING, ""
    if last["from"] == ClusterState.DONE:
        mismatch = "" if swapped is None else _field(swapped, "reason")
        if mismatch.startswith(PROBE_MISMATCH):
            return (RoundOutcome.PROBE_MISMATCH,
                    f"{mismatch.removeprefix(PROBE_MISMATCH)}; {rolled_back(int(_field(last, 'round')), load)}")
        return RoundOutcome.REARRANGED, ""
    reason = str(last["reason"])
    if reason.startswith(GATED):
        return RoundOutcome.SKIPPED, reason.removeprefix(GATED).strip()
    return RoundOutcome.ABORTED, reason or f"{last['from']} -> {last['to']} ({last['trigger']})"


def rolled_back(round_: int, load: Mapping[str, Any] | None) -> str:
    """What follows round ``round_``'s failed probe (:mod:`fdeplb.orchestration.rollback`): round ``round_ + 1``
    goes back to the placement it replaced, unless its ``load`` record says it was itself a rollback (then none
    follows). A ``load`` whose detail does not parse reads as no rollback's."""
    try:
        facts = None if load is None else supplied_of(load)
    except (ValueError, KeyError, TypeError, InputError):
        facts = None
    if facts is not None and facts["kind"] == "rollback":
        return (f"round {round_} was the rollback of round {facts['undoes']}: not rolled back again, the swapped "
                f"placement stays live until a later round swaps with no probe failing")
    return f"rollback: round {round_ + 1} goes back to the placement round {round_} replaced"


def _field(record: Mapping[str, Any], name: str) -> str:
    """A field of an audit record as text ("" when absent): a mapping, or a store AuditRecord (no ``get``)."""
    value = record.get(name, "") if hasattr(record, "get") else record[name]
    return "" if value is None else str(value)


def _rank(item: Any) -> int:
    """The ``ep_rank`` of a detail item (a JSON object), checked (:func:`~fdeplb.checks.check_int`, >= 0)."""
    if not isinstance(item, dict):
        raise InputError(f"a detail item is {type(item).__name__}, not an object")
    return check_int(item["ep_rank"], "ep_rank", lo=0)


def _items(reason: str, prefix: str, item: re.Pattern, value):
    """Schema 1 only: the items of a reason text written before the detail field existed."""
    if not reason.startswith(prefix):
        return None
    out = {}
    for part in reason[len(prefix):].split(", "):
        m = item.fullmatch(part)
        if m is None:
            return None
        out[int(m[1])] = value(m)
    return out or None
