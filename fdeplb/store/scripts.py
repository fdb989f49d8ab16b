"""The KEYS / ARGV contract of the Lua scripts in ``lua/``, built in one place with named slots.

Every script documents its slots in a header comment; :data:`COMMIT_KEYS` / :data:`COMMIT_ARGV`,
:data:`AUDIT_KEYS` / :data:`AUDIT_ARGV`, :data:`AUDIT_TRIM_KEYS` / :data:`AUDIT_TRIM_ARGV`, :data:`LEASE_KEYS` /
:data:`LEASE_ARGV`, :data:`SWITCH_KEYS` / :data:`SWITCH_ARGV`, :data:`WEIGHTS_CANCEL_KEYS` /
:data:`WEIGHTS_CANCEL_ARGV` and :data:`PUBLISH_KEYS` / :data:`PUBLISH_ARGV` name the same slots in the same order
(tests check the headers agree). :func:`commit_call`, :func:`audit_call`, :func:`audit_trim_call`,
:func:`lease_call`, :func:`switch_call`, :func:`weights_cancel_call` and :func:`publish_call` are the only places that
lay out a script call.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any, Mapping, Sequence

from fdeplb.machines.tables import Effect, Guard, GuardKind, StateEnum
from fdeplb.store.keys import Keys

#: commit.lua KEYS[1..8], in order; per-rank guard keys follow from KEYS[len(COMMIT_KEYS) + 1] on.
COMMIT_KEYS = ("record", "audit", "lease", "rearrange", "placement", "plan", "audit_head", "signal")
#: entries kept in the signal stream (``XADD MAXLEN ~``); commit.lua writes the same literal (tests/test_scripts.py).
SIGNAL_MAXLEN = 64
#: commit.lua ARGV[1..10], in order.
COMMIT_ARGV = ("expected_state", "expected_version", "fence", "new_state", "fields", "audit", "guards", "effect",
               "signal", "chain_order", "generation")
#: audit fields commit.lua appends after the caller's, in this order (their values are the server's).
COMMIT_FILLED = ("version", "fence", "ts_ms")
#: commit.lua's error codes (first element of a refusal reply); nothing is written on any of them.
COMMIT_ERRORS = ("ERR_FENCE", "ERR_STALE", "ERR_GUARD", "ERR_GENERATION")

#: audit.lua KEYS[1..3] and ARGV[1..5], in order (an audit record that is not a transition: an alarm; with the change
#: a note records, written in the same step: the keys it writes follow from KEYS[len(AUDIT_KEYS) + 1] on).
AUDIT_KEYS = ("audit", "audit_head", "lease")
AUDIT_ARGV = ("fence", "audit", "chain_order", "delete", "hset")
#: audit fields audit.lua appends after the caller's, in this order.
AUDIT_FILLED = ("fence", "ts_ms")

#: lease.lua KEYS[1..2] and ARGV[1..3], in order.
LEASE_KEYS = ("lease", "fence")
LEASE_ARGV = ("op", "value", "ttl_ms")
#: lease.lua operations.
LEASE_OPS = ("acquire", "renew", "release")


#: the scripts that append to the audit stream: :func:`script_text` puts :data:`CHAIN_PRELUDE` before each
CHAINED = ("commit", "audit", "weights_cancel")
#: the scripts that only check the lease fence (``fence_refused``): :data:`CHAIN_PRELUDE` is put before them too
FENCED = ("audit_trim",)
#: ``lua/_chain.lua``: the audit chain (``audit_chain``, ``append_chained``) and the fence check, defined once for
#: every script in :data:`CHAINED` and :data:`FENCED`; :func:`audit_chain` is its Python twin
#: (:func:`fdeplb.replay.chain_of` checks an export with it).
CHAIN_PRELUDE = "_chain"

#: audit_trim.lua KEYS[1..2] and ARGV[1..2], in order.
AUDIT_TRIM_KEYS = ("audit", "lease")
AUDIT_TRIM_ARGV = ("fence", "minid")


def lua_file(name: str) -> str:
    """Text of ``lua/<name>.lua`` as shipped with the package (a prelude not put before it)."""
    return (resources.files("fdeplb.store") / "lua" / f"{name}.lua").read_text()


def script_text(name: str) -> str:
    """Source of script ``name`` as Redis runs it: ``lua/<name>.lua``, with the audit-chain prelude
    (``lua/_chain.lua``) before it for the scripts that append to the audit stream (:data:`CHAINED`) or check the
    lease fence (:data:`FENCED`)."""
    text = lua_file(name)
    return lua_file(CHAIN_PRELUDE) + text if name in CHAINED + FENCED else text


@dataclass(frozen=True)
class CommitCall:
    """The arguments of one ``commit.lua`` call."""

    keys: list[str]
    args: list[str | bytes]


def _flat(mapping: Mapping[str, str]) -> list[str]:
    return [x for kv in mapping.items() for x in kv]


def _pairs(mapping: Mapping[str, str]) -> str:
    return json.dumps(_flat(mapping))


@functools.lru_cache(maxsize=256)
def chain_order(names: tuple[str, ...]) -> str:
    """The ``chain_order`` argument of commit.lua / audit.lua: JSON array of the 1-based positions of ``names`` (the
    audit record's field names in stream order, the script-filled ones included) sorted by name in byte order,
    the order :func:`fdeplb.replay.chain_of` hashes them in. Sorted here, once per set of names, not by the script
    on every call. Raises ValueError on a repeated name (the chain hashes each field once)."""
    if len(set(names)) != len(names):
        raise ValueError(f"audit field names repeat: {sorted(names)}")
    return json.dumps(sorted(range(1, len(names) + 1), key=lambda i: names[i - 1].encode()))


def audit_chain(previous: str, fields: Mapping[str, str]) -> str:
    """The audit chain of a record whose fields (every one but ``chain``; values as text) are ``fields``, after
    ``previous`` (the predecessor's chain, "" for the first record): SHA-1 hex of ``previous``, a newline, then for
    every field by name in byte order (as :func:`chain_order` sorts them) ``name=<byte length of value>:value`` and
    a newline; ``lua/_chain.lua``'s ``audit_chain`` computes the same with ``redis.sha1hex``."""
    parts = [previous, "\n"]
    for name in sorted(fields, key=str.encode):
        parts.append(f"{name}={len(fields[name].encode())}:{fields[name]}\n")
    return hashlib.sha1("".join(parts).encode()).hexdigest()


def commit_call(keys: Keys, *, record_key: str, expected_state: StateEnum, expected_version: int, fence: str,
                new_state: StateEnum, fields: dict[str, str], audit: dict[str, str],
                guards: Sequence[Guard], effect: Effect, plan_id: str, plan_key: str, ep_size: int,
                signal: bool = False, generation: int | None = None) -> CommitCall:
    """Lay out a ``commit.lua`` call.

    ``guards`` are the transition's guards; a per-rank guard (:attr:`GuardKind.per_rank`) adds one key per EP rank
    (``ep_size`` of them) after the fixed keys and tells the script where its range starts. ``plan_id`` is what
    ``same_plan`` guards and :attr:`GuardKind.PLAN_NOT_CURRENT` compare against; ``plan_key`` is the hash of that
    plan (``plan_stored`` and :attr:`Effect.SET_PLACEMENT` read it). ``signal``: also wake the rank agents
    (:attr:`fdeplb.machines.tables.TransitionSpec.wakes_ranks`). ``generation``: the cluster generation the
    caller read (the script refuses the commit if the stored one is newer); None = not fenced by generation.
    A per-rank guard also passes each rank's member record: the script counts only ACTIVE members.
    """
    fixed = {"record": record_key, "audit": keys.audit, "lease": keys.lease, "rearrange": keys.rearrange,
             "placement": keys.placement, "plan": plan_key, "audit_head": keys.audit_head,
             "signal": keys.signal}
    key_list = [fixed[name] for name in COMMIT_KEYS]
    guard_args: list[dict[str, Any]] = []
    for g in guards:
        entry: dict[str, Any] = {
            "kind": g.kind.value, "state": g.state.value if g.state else "",
            "states": [s.value for s in g.states],
            "plan_id": plan_id if g.same_plan or g.kind is GuardKind.PLAN_NOT_CURRENT else "",
            "first": 0, "count": 0, "members": 0,
        }
        if g.kind.per_rank:
            entry["first"] = len(key_list) + 1  # Lua is 1-based
            entry["count"] = ep_size
            make = keys.rank if g.kind is GuardKind.RANKS_IN else keys.weights
            key_list.extend(make(r) for r in range(ep_size))
            entry["members"] = len(key_list) + 1
            key_list.extend(keys.member(r) for r in range(ep_size))
        guard_args.append(entry)
    argv = {
        "expected_state": expected_state.value, "expected_version": str(int(expected_version)), "fence": fence,
        "new_state": new_state.value, "fields": _pairs(fields), "audit": _pairs(audit),
        "guards": json.dumps(guard_args), "effect": effect.value, "signal": "1" if signal else "",
        "chain_order": chain_order((*audit, *COMMIT_FILLED)),
        "generation": "" if generation is None else str(int(generation)),
    }
    return CommitCall(keys=key_list, args=[argv[name] for name in COMMIT_ARGV])


def audit_call(keys: Keys, *, fence: str, audit: dict[str, str], delete: Sequence[str] = (),
               hset: Mapping[str, Mapping[str, str]] | None = None) -> CommitCall:
    """Lay out an ``audit.lua`` call: append ``audit`` (fields as text; fence, ts_ms and chain are added by the
    script) to the audit stream, refused unless ``fence`` ("" = unfenced) holds the lease. The change the note
    records, written by the script in the same step after the record is appended (so never without it): the keys
    ``delete`` names are deleted, then each hash of ``hset`` gets its fields (text, as stored; e.g. a
    ``config_changed`` note's configuration, a withdrawn round request's cluster-record fields, a repaired member
    record: deleted and written again). ValueError for an empty mapping in ``hset``."""
    written = list(dict.fromkeys([*delete, *(hset or {})]))
    position = {key: len(AUDIT_KEYS) + 1 + i for i, key in enumerate(written)}  # Lua is 1-based
    if any(not fields for fields in (hset or {}).values()):
        raise ValueError("audit_call: a hash to write has no fields")
    fixed = {"audit": keys.audit, "audit_head": keys.audit_head, "lease": keys.lease}
    argv = {"fence": fence, "audit": _pairs(audit), "chain_order": chain_order((*audit, *AUDIT_FILLED)),
            "delete": json.dumps([position[key] for key in delete]),
            "hset": json.dumps([[position[key], _flat(fields)]
                                for key, fields in (hset or {}).items()])}
    return CommitCall(keys=[fixed[n] for n in AUDIT_KEYS] + written, args=[argv[n] for n in AUDIT_ARGV])


def audit_trim_call(keys: Keys, *, fence: str, minid: str) -> CommitCall:
    """Lay out an ``audit_trim.lua`` call: trim the audit records below stream id ``minid``, refused unless
    ``fence`` ("" = unfenced) holds the lease."""
    fixed = {"audit": keys.audit, "lease": keys.lease}
    argv = {"fence": fence, "minid": minid}
    return CommitCall(keys=[fixed[n] for n in AUDIT_TRIM_KEYS], args=[argv[n] for n in AUDIT_TRIM_ARGV])


def lease_call(keys: Keys, op: str, value: str, ttl_ms: int) -> CommitCall:
    """Lay out a ``lease.lua`` call (``op`` one of :data:`LEASE_OPS`)."""
    if op not in LEASE_OPS:
        raise ValueError(f"lease.lua has no op {op!r}")
    fixed = {"lease": keys.lease, "fence": keys.fence}
    argv = {"op": op, "value": value, "ttl_ms": str(int(ttl_ms))}
    return CommitCall(keys=[fixed[n] for n in LEASE_KEYS], args=[argv[n] for n in LEASE_ARGV])


# ---- switch.lua: an armed rank's safe point ----------------------------------------------------------------------
#: switch.lua KEYS[1..2], in order; every rank's record follows from KEYS[len(SWITCH_KEYS) + 1] on (ep_rank order),
#: then every rank's member record.
SWITCH_KEYS = ("rearrange", "rank")
#: switch.lua ARGV[1..8], in order.
SWITCH_ARGV = ("armed", "step", "field", "current", "margin", "withdrawn", "chunks", "chunks_field")
#: switch.lua's statuses (second element of its reply).
SWITCH_STATUSES = ("fixed", "set", "waiting", "gone", "cancelled")


def switch_call(keys: Keys, *, ep_rank: int, ep_size: int, armed: str, step: int, field: str,
                current: dict[str, str], margin: int, withdrawn: dict[str, str] | None = None,
                chunks: tuple[int, ...] = (), chunks_field: str = "") -> CommitCall:
    """Lay out a ``switch.lua`` call: rank ``ep_rank`` (of ``ep_size``) publishes ``step`` armed for ``armed`` and
    reads or fixes the switch step kept in the cluster-record ``field``, while the cluster-record fields ``current``
    hold their values and none of ``withdrawn`` holds its value (then: ``cancelled``, nothing written).
    ``chunks``: the rank's chunk layout (first layer of each chunk); ``chunks_field``: the cluster-record field the
    fixed layout (their union over the ranks) is kept in ("" = none)."""
    fixed = {"rearrange": keys.rearrange, "rank": keys.rank(ep_rank)}
    argv = {"armed": armed, "step": str(int(step)), "field": field, "current": _pairs(current),
            "margin": str(int(margin)), "withdrawn": _pairs(withdrawn or {}),
            "chunks": json.dumps([int(c) for c in chunks]), "chunks_field": chunks_field}
    return CommitCall(keys=[fixed[n] for n in SWITCH_KEYS] + [keys.rank(r) for r in range(ep_size)]
                      + [keys.member(r) for r in range(ep_size)],
                      args=[argv[n] for n in SWITCH_ARGV])


# ---- weights_cancel.lua: withdraw a weight request nobody can switch ----------------------------------------------
#: weights_cancel.lua KEYS[1..5], in order; every rank's weight-status record follows (ep_rank order).
WEIGHTS_CANCEL_KEYS = ("rearrange", "audit", "audit_head", "lease", "signal")
#: weights_cancel.lua ARGV[1..7], in order.
WEIGHTS_CANCEL_ARGV = ("request", "fence", "busy", "held_by", "reason", "audit", "chain_order")
#: audit fields weights_cancel.lua appends after the caller's, in this order (the cluster record's and the server's).
WEIGHTS_CANCEL_FILLED = ("from", "to", "version", "fence", "ts_ms")
#: weights_cancel.lua's first reply elements: withdrawn now, withdrawn before, and its refusals (nothing written).
WEIGHTS_CANCEL_REPLIES = ("OK", "ALREADY", "ERR_FENCE", "ERR_GONE", "ERR_SWITCHED", "ERR_APPLIED")


def weights_cancel_call(keys: Keys, *, ep_size: int, request: int, fence: str, busy: Sequence[StateEnum],
                        held_by: Sequence[int], reason: str, audit: dict[str, str]) -> CommitCall:
    """Lay out a ``weights_cancel.lua`` call: withdraw weight request ``request`` (refused once its switch step is
    fixed or a rank of ``ep_size`` carried it out), keeping ``held_by`` and ``reason`` in the cluster record and
    appending ``audit`` (from, to, version, fence, ts_ms and chain added by the script)."""
    fixed = {"rearrange": keys.rearrange, "audit": keys.audit, "audit_head": keys.audit_head, "lease": keys.lease,
             "signal": keys.signal}
    argv = {"request": str(int(request)), "fence": fence, "busy": json.dumps([s.value for s in busy]),
            "held_by": ",".join(str(int(r)) for r in held_by), "reason": reason, "audit": _pairs(audit),
            "chain_order": chain_order((*audit, *WEIGHTS_CANCEL_FILLED))}
    return CommitCall(keys=[fixed[n] for n in WEIGHTS_CANCEL_KEYS] + [keys.weights(r) for r in range(ep_size)],
                      args=[argv[n] for n in WEIGHTS_CANCEL_ARGV])


# ---- publish.lua: a rank's load window in one round trip ---------------------------------------------------------
#: publish.lua KEYS[1..2] and ARGV[1..3], in order; the encoded window's field, value pairs follow ARGV[3].
PUBLISH_KEYS = ("load", "events")
PUBLISH_ARGV = ("events_maxlen", "ep_rank", "round")


def publish_call(keys: Keys, *, ep_rank: int, round_: int, window: dict[str, Any], events_maxlen: int) -> CommitCall:
    """Lay out a ``publish.lua`` call: rank ``ep_rank``'s encoded window (:func:`fdeplb.store.arrays.encode`
    fields) for round ``round_``, stamped with the server's clock, and its ``load_published`` event."""
    fixed = {"load": keys.load(ep_rank), "events": keys.events}
    argv = {"events_maxlen": str(int(events_maxlen)), "ep_rank": str(int(ep_rank)), "round": str(int(round_))}
    return CommitCall(keys=[fixed[n] for n in PUBLISH_KEYS],
                      args=[argv[n] for n in PUBLISH_ARGV] + [x for kv in window.items() for x in kv])
