"""The Lua scripts called directly against a real Redis: the KEYS/ARGV contract, a good call, every refusal code with
nothing written, and the key strings pinned (rq's tests/test_scripts.py and tests/test_registry.py are the model)."""

from __future__ import annotations

import json

import pytest
import redis

from fdeplb.machines.tables import CLUSTER, RANK, WEIGHTS, Effect, Guard, GuardKind, RankState, WeightState
from fdeplb.recording import audit_dict
from fdeplb.replay import chain_of
from fdeplb.store import AuditRecord
from fdeplb.store.keys import Keys
from fdeplb.store.machine_io import AUDIT_FIELDS
from fdeplb.store.scripts import (
    AUDIT_ARGV,
    AUDIT_FILLED,
    AUDIT_KEYS,
    CHAIN_PRELUDE,
    CHAINED,
    COMMIT_ARGV,
    COMMIT_ERRORS,
    COMMIT_FILLED,
    COMMIT_KEYS,
    LEASE_ARGV,
    LEASE_KEYS,
    SIGNAL_MAXLEN,
    audit_call,
    chain_order,
    commit_call,
    lease_call,
    lua_file,
    script_text,
)
from tests.helpers import RawRedis, header_slots


def test_python_slot_names_match_the_lua_headers():
    assert header_slots("commit", "KEYS") == list(COMMIT_KEYS)
    assert header_slots("commit", "ARGV") == list(COMMIT_ARGV)
    assert header_slots("audit", "ARGV") == list(AUDIT_ARGV)
    assert header_slots("lease", "KEYS") == list(LEASE_KEYS)
    assert header_slots("lease", "ARGV") == list(LEASE_ARGV)
    for code in COMMIT_ERRORS:
        assert f"'{code}'" in script_text("commit")


def test_key_strings_are_pinned():
    k = Keys("c1")
    assert (k.rearrange, k.rank(3), k.weights(3), k.load(3), k.snapshot(7), k.plan("ab"), k.placement, k.audit,
            k.audit_head, k.events, k.signal, k.lease, k.fence, k.ranks, k.config) == (
        "fdeplb:{c1}:rearrange", "fdeplb:{c1}:rank:3", "fdeplb:{c1}:weights:3", "fdeplb:{c1}:load:3",
        "fdeplb:{c1}:snapshot:7", "fdeplb:{c1}:plan:ab", "fdeplb:{c1}:placement", "fdeplb:{c1}:audit",
        "fdeplb:{c1}:audit_head", "fdeplb:{c1}:events", "fdeplb:{c1}:signal", "fdeplb:{c1}:lease",
        "fdeplb:{c1}:fence", "fdeplb:{c1}:ranks", "fdeplb:{c1}:config")


def test_every_key_of_a_cluster_shares_one_hash_slot():
    from redis.crc import key_slot

    k = Keys("c1")
    keys = [k.rearrange, k.rank(0), k.weights(9), k.load(1), k.snapshot(1), k.plan("x"), k.placement, k.audit,
            k.audit_head, k.events, k.signal, k.lease, k.fence, k.ranks, k.config]
    assert len({key_slot(key.encode()) for key in keys}) == 1


def test_commit_call_lays_out_per_rank_guards_after_the_fixed_keys():
    k = Keys("c1")
    spec = CLUSTER.spec("LOADING", "loaded")
    call = commit_call(k, record_key=k.rearrange, expected_state=spec.sources[0], expected_version=4, fence="1:a",
                       new_state=spec.dest, fields={"deadline_ms": "0"}, audit={"machine": "cluster"},
                       guards=spec.guards, effect=spec.effect, plan_id="p1", plan_key=k.plan("p1"), ep_size=3)
    assert call.keys[:len(COMMIT_KEYS)] == [k.rearrange, k.audit, k.lease, k.rearrange, k.placement, k.plan("p1"),
                                            k.audit_head, k.signal]
    assert call.keys[len(COMMIT_KEYS):] == [k.rank(0), k.rank(1), k.rank(2), k.member(0), k.member(1), k.member(2)]
    args = dict(zip(COMMIT_ARGV, call.args))
    guards = json.loads(args["guards"])
    assert guards == [{"kind": "ranks_in", "state": "LOADED", "states": [], "plan_id": "p1",
                       "first": len(COMMIT_KEYS) + 1, "count": 3, "members": len(COMMIT_KEYS) + 4}]
    assert (args["expected_state"], args["expected_version"], args["new_state"], args["effect"]) == (
        "LOADING", "4", "LOAD_SUCC", "")
    assert json.loads(args["fields"]) == ["deadline_ms", "0"]


def test_chain_order_lists_the_audit_names_in_byte_order():
    """The scripts hash the audit record in the order chain_order gives, so it must be the byte order of every name
    the record will hold (the caller's, then the ones the script fills) whatever they are: a new audit field sorts
    into place. The store's own field set is checked by name, and names where byte order is not the order a naive
    sort of the caller's names alone would give."""
    k = Keys("c1")
    for audit in ({n: "x" for n in AUDIT_FIELDS}, {}, {"machine": "cluster"},
                  {"zz": "1", "Version": "2", "fences": "3", "ts": "4", "_": "5", "t\u00e9": "6", "te": "7"}):
        call = commit_call(k, record_key=k.rank(0), expected_state=RankState.IDLE, expected_version=0, fence="",
                           new_state=RankState.LOADING, fields={}, audit=audit, guards=(), effect=Effect.NONE,
                           plan_id="", plan_key=k.plan("_none"), ep_size=0)
        names = [*audit, *COMMIT_FILLED]
        order = json.loads(dict(zip(COMMIT_ARGV, call.args))["chain_order"])
        assert [names[i - 1] for i in order] == sorted(names, key=str.encode)
        names = [*audit, *AUDIT_FILLED]
        order = json.loads(dict(zip(AUDIT_ARGV, audit_call(k, fence="", audit=audit).args))["chain_order"])
        assert [names[i - 1] for i in order] == sorted(names, key=str.encode)
    full = json.loads(chain_order((*AUDIT_FIELDS, *COMMIT_FILLED)))
    assert [[*AUDIT_FIELDS, *COMMIT_FILLED][i - 1] for i in full] == [
        "actor", "fence", "from", "key", "machine", "plan_id", "reason", "round", "to", "trigger", "ts_ms", "version"]
    with pytest.raises(ValueError, match="repeat"):
        commit_call(k, record_key=k.rank(0), expected_state=RankState.IDLE, expected_version=0, fence="",
                    new_state=RankState.LOADING, fields={}, audit={"version": "3"}, guards=(), effect=Effect.NONE,
                    plan_id="", plan_key=k.plan("_none"), ep_size=0)


@pytest.fixture
def raw(redis_url, cluster_id):
    raw = RawRedis(redis_url, cluster_id)
    yield raw
    keys = list(raw.r.scan_iter(match=f"fdeplb:[{{]{cluster_id}[}}]:*"))
    if keys:
        raw.r.delete(*keys)


def run_commit(raw: RawRedis, *, state="NORMAL", version=0, fence="", new_state="UPDATING", guards=(),
               effect=Effect.NONE, plan_id="", ep_size=2, record=None):
    k = raw.keys
    call = commit_call(k, record_key=record or k.weights(0), expected_state=WeightState(state)
                       if state in WeightState.__members__ else RankState(state), expected_version=version,
                       fence=fence, new_state=WeightState(new_state) if new_state in WeightState.__members__
                       else RankState(new_state), fields={"reason": "r"},
                       audit={"machine": "weights", "key": "weights:0"}, guards=guards, effect=effect,
                       plan_id=plan_id, plan_key=k.plan(plan_id or "_none"), ep_size=ep_size)
    return raw.r.register_script(script_text("commit"))(keys=call.keys, args=call.args)


def test_commit_lua_good_call_writes_record_and_audit(raw):
    raw.force(raw.keys.weights(0), "NORMAL", version=0)
    reply = run_commit(raw)
    assert reply[0] == b"OK" and reply[1] == b"1"
    rec = raw.r.hgetall(raw.keys.weights(0))
    assert rec[b"state"] == b"UPDATING" and rec[b"version"] == b"1" and rec[b"reason"] == b"r"
    [(entry_id, fields)] = raw.r.xrange(raw.keys.audit)
    assert entry_id == reply[2] and fields[b"version"] == b"1" and fields[b"ts_ms"] == reply[3]
    # stream order: the caller's audit fields, then version, fence, ts_ms, chain
    assert list(fields) == [b"machine", b"key", b"version", b"fence", b"ts_ms", b"chain"]


def raw_entries(raw: RawRedis) -> list[tuple[str, dict[str, str]]]:
    return [(i.decode(), {k.decode(): v.decode() for k, v in f.items()}) for i, f in raw.r.xrange(raw.keys.audit)]


@pytest.mark.parametrize("audit", [{n: f"v{i} \u00e9" for i, n in enumerate(AUDIT_FIELDS)}, {},
                                   {"zz": "1", "Version": "", "fences": "3", "ts": "4", "_": "5", "te": "7"}])
def test_both_scripts_chain_every_record_as_replay_computes_it(raw, audit):
    """commit.lua and audit.lua, called in turn, leave a chain that chain_of recomputes from the stream entries
    alone, whatever the audit names (a new field cannot break the chain silently), and audit_head holds the last."""
    raw.force(raw.keys.weights(0), "NORMAL", version=0)
    commit = raw.r.register_script(script_text("commit"))
    append = raw.r.register_script(script_text("audit"))
    k = raw.keys
    states = (WeightState.NORMAL, WeightState.UPDATING, WeightState.NORMAL)
    for version in range(2):
        call = commit_call(k, record_key=k.weights(0), expected_state=states[version], expected_version=version,
                           fence="", new_state=states[version + 1], fields={}, audit=audit, guards=(),
                           effect=Effect.NONE, plan_id="", plan_key=k.plan("_none"), ep_size=0)
        assert commit(keys=call.keys, args=call.args)[0] == b"OK"
        call = audit_call(k, fence="", audit={**audit, "version": str(version + 1)})
        assert append(keys=call.keys, args=call.args)[0] == b"OK"
    chain = ""
    entries = raw_entries(raw)
    assert len(entries) == 4
    for entry_id, fields in entries:
        assert list(fields)[:len(audit)] == list(audit)  # the caller's fields first, in the caller's order
        chain = chain_of(chain, audit_dict(AuditRecord(entry_id, fields)))
        assert fields["chain"] == chain
    assert raw.r.get(k.audit_head).decode() == chain


def test_audit_lua_writes_the_change_its_note_records_or_nothing(raw):
    """The keys a note's change writes follow the fixed ones: deleted, then written (HSET); checked before anything
    is written, so a change onto a key that is not a hash, or a slot naming no written key, leaves nothing."""
    k = raw.keys
    append = raw.r.register_script(script_text("audit"))
    raw.r.hset(k.rearrange, mapping={"requested": "2", "round": "1"})
    raw.r.hset(k.member(0), mapping={"state": "BOGUS", "junk": "x"})
    raw.r.hset(k.supplied_placement, "facts", "{}")
    call = audit_call(k, fence="", audit={"machine": "m"}, delete=[k.member(0), k.supplied_placement],
                      hset={k.rearrange: {"requested": "1"}, k.member(0): {"state": "ACTIVE", "version": "0"}})
    assert call.keys[len(AUDIT_KEYS):] == [k.member(0), k.supplied_placement, k.rearrange]
    assert append(keys=call.keys, args=call.args)[0] == b"OK"
    assert raw.r.hgetall(k.rearrange) == {b"requested": b"1", b"round": b"1"}
    assert raw.r.hgetall(k.member(0)) == {b"state": b"ACTIVE", b"version": b"0"}  # replaced, not merged
    assert not raw.r.exists(k.supplied_placement) and raw.audit_len() == 1
    raw.r.set(k.config, "not a hash")
    call = audit_call(k, fence="", audit={"machine": "m"}, hset={k.config: {"version": "1"}})
    args = dict(zip(AUDIT_ARGV, call.args))
    before = raw.snapshot()
    with pytest.raises(redis.ResponseError, match="holds a string, not a hash"):
        append(keys=call.keys, args=call.args)
    with pytest.raises(redis.ResponseError, match="not a position of a written key"):
        append(keys=call.keys, args=[*call.args[:-2], json.dumps([3]), args["hset"]])  # the lease is not written
    assert raw.snapshot() == before
    with pytest.raises(ValueError, match="no fields"):
        audit_call(k, fence="", audit={}, hset={k.config: {}})


@pytest.mark.parametrize("previous,fields", [
    ("", {}),
    ("", {"a": ""}),
    ("0" * 40, {"machine": "cluster", "key": "cluster", "from": "FREE", "round": "3", "ts_ms": "1700000000000"}),
    ("x", {"\u00e9": "\u00fc", "e": "x", "z\U0001F600": "\U0001F600", "Z": "1", "_": "3"}),  # byte order, not text
    ("prev", {"reason": "a=b:c\nd", "plan_id": "", "ver": " 1 "}),
])
def test_the_lua_chain_prelude_computes_chain_of(raw, previous, fields):
    """lua/_chain.lua's audit_chain, the one Lua definition of the audit chain, against its Python twin
    (fdeplb.replay.chain_of): any names and values, unicode (lengths in bytes), empty values, separators in values."""
    script = lua_file(CHAIN_PRELUDE) + "return audit_chain(ARGV[1], cjson.decode(ARGV[2]), cjson.decode(ARGV[3]))"
    pairs = [x for kv in fields.items() for x in kv]
    got = raw.r.eval(script, 0, previous, json.dumps(pairs), chain_order(tuple(fields)))
    assert got.decode() == chain_of(previous, fields)


def test_the_scripts_that_append_to_the_audit_share_the_chain_prelude():
    """commit.lua, audit.lua and weights_cancel.lua run with lua/_chain.lua before them and compute no chain, lease
    fence or time stamp of their own."""
    prelude = lua_file(CHAIN_PRELUDE)
    assert "sha1hex" in prelude and "'TIME'" in prelude and "ERR_FENCE" in prelude
    for name in CHAINED:
        assert script_text(name) == prelude + lua_file(name)
        assert "sha1hex" not in lua_file(name) and "append_chained(" in lua_file(name)
        assert "'TIME'" not in lua_file(name) and "now_ms()" in lua_file(name)
        assert "ERR_FENCE'" not in lua_file(name) and "fence_refused(" in lua_file(name)
    assert "append_chained" not in script_text("lease") and "sha1hex" not in script_text("lease")


@pytest.mark.parametrize("script", ["commit", "audit"])
def test_a_chain_order_that_misses_a_field_is_refused_with_nothing_written(raw, script):
    raw.force(raw.keys.weights(0), "NORMAL", version=0)
    k = raw.keys
    if script == "commit":
        call = commit_call(k, record_key=k.weights(0), expected_state=WeightState.NORMAL, expected_version=0,
                           fence="", new_state=WeightState.UPDATING, fields={"reason": "r"}, audit={"machine": "w"},
                           guards=(), effect=Effect.NONE, plan_id="", plan_key=k.plan("_none"), ep_size=0)
        names = COMMIT_ARGV
    else:
        call = audit_call(k, fence="", audit={"machine": "w"})
        names = AUDIT_ARGV
    args = dict(zip(names, call.args))
    args["chain_order"] = json.dumps(json.loads(args["chain_order"])[:-1])
    before = raw.snapshot()
    with pytest.raises(redis.ResponseError, match="chain_order names"):
        raw.r.register_script(script_text(script))(keys=call.keys, args=[args[n] for n in names])
    assert raw.snapshot() == before


def test_only_transitions_marked_wakes_ranks_signal_the_rank_agents(raw):
    """A rank's or weight record's commit wakes no agent; a cluster transition marked ``wakes_ranks`` appends one
    signal entry, capped at SIGNAL_MAXLEN (the literal commit.lua writes). Only "plan" and "loaded" (into states
    where no rank has work) are silent."""
    assert {t.trigger for t in CLUSTER.transitions if not t.wakes_ranks} == {"plan", "loaded", "swapped"}
    assert not any(t.wakes_ranks for table in (RANK, WEIGHTS) for t in table.transitions)
    assert f"'MAXLEN', '~', '{SIGNAL_MAXLEN}'" in script_text("commit")
    raw.force(raw.keys.weights(0), "NORMAL", version=0)
    assert run_commit(raw)[0] == b"OK"
    assert raw.r.xlen(raw.keys.signal) == 0
    raw.force(raw.keys.rearrange, "FREE", version=2)
    raw.r.hset(raw.keys.rearrange, "round", "7")
    k = raw.keys
    spec = CLUSTER.spec("FREE", "start")
    call = commit_call(k, record_key=k.rearrange, expected_state=spec.sources[0], expected_version=2, fence="",
                       new_state=spec.dest, fields={}, audit={"machine": "cluster"}, guards=(),
                       effect=spec.effect, plan_id="", plan_key=k.plan("_none"), ep_size=2, signal=spec.wakes_ranks)
    assert raw.r.register_script(script_text("commit"))(keys=call.keys, args=call.args)[0] == b"OK"
    [(_, fields)] = raw.r.xrange(k.signal)
    assert fields == {b"state": b"COLLECTING", b"round": b"7", b"version": b"3"}


@pytest.mark.parametrize("case,code", [
    ("missing record", "ERR_STALE"),
    ("wrong state", "ERR_STALE"),
    ("wrong version", "ERR_STALE"),
    ("fence not held", "ERR_FENCE"),
    ("guard refuses", "ERR_GUARD"),
    ("set_placement without a plan", "ERR_GUARD"),
])
def test_commit_lua_refusals_write_nothing(raw, case, code):
    raw.force(raw.keys.weights(0), "NORMAL", version=3)
    raw.force(raw.keys.rank(0), "IDLE", version=0)
    raw.force(raw.keys.rank(1), "LOADING", version=0)
    kwargs: dict = {"version": 3}
    if case == "missing record":
        kwargs["record"] = raw.keys.weights(7)
    elif case == "wrong state":
        kwargs["state"] = "CLEARED"
    elif case == "wrong version":
        kwargs["version"] = 2
    elif case == "fence not held":
        kwargs["fence"] = "9:ghost"
    elif case == "guard refuses":
        kwargs["guards"] = (Guard(GuardKind.RANKS_IN, state=RankState.IDLE),)
    else:
        kwargs["effect"] = Effect.SET_PLACEMENT
        kwargs["plan_id"] = "nope"
    before = raw.snapshot()
    reply = run_commit(raw, **kwargs)
    assert reply[0].decode() == code
    assert raw.snapshot() == before


def test_commit_lua_rejects_an_unknown_guard_kind(raw):
    raw.force(raw.keys.weights(0), "NORMAL", version=0)
    k = raw.keys
    call = commit_call(k, record_key=k.weights(0), expected_state=WeightState.NORMAL, expected_version=0, fence="",
                       new_state=WeightState.UPDATING, fields={}, audit={}, guards=(), effect=Effect.NONE,
                       plan_id="", plan_key=k.plan("_none"), ep_size=0)
    args = dict(zip(COMMIT_ARGV, call.args), guards=json.dumps([{"kind": "bogus"}]))
    before = raw.snapshot()
    with pytest.raises(redis.ResponseError, match="unknown guard kind bogus"):
        raw.r.register_script(script_text("commit"))(keys=call.keys, args=[args[n] for n in COMMIT_ARGV])
    assert raw.snapshot() == before


def test_lease_lua_acquire_renew_release_and_a_monotonic_fence(raw):
    script = raw.r.register_script(script_text("lease"))

    def op(name, value, ttl=60_000):
        call = lease_call(raw.keys, name, value, ttl)
        return script(keys=call.keys, args=call.args)

    first = op("acquire", "a")
    assert first == b"1:a" and op("acquire", "b") is None  # held: refused
    assert op("renew", "1:a") == b"1:a" and op("renew", "1:b") is None
    assert op("release", "1:b") == 0 and op("release", "1:a") == 1
    assert op("acquire", "b") == b"2:b"  # a fresh fence, never reused
    assert raw.r.get(raw.keys.fence) == b"2"
    with pytest.raises(ValueError):
        lease_call(raw.keys, "steal", "x", 1)
    op("release", "2:b")
    raw.r.set(raw.keys.fence, "abc")  # not a counter: refused naming the key, nothing written
    before = raw.snapshot()
    with pytest.raises(redis.ResponseError, match=r"corrupt fence counter fdeplb:\{.*\}:fence holds \"abc\""):
        op("acquire", "c")
    assert raw.snapshot() == before and raw.r.get(raw.keys.lease) is None


def test_tables_name_only_guards_the_script_implements():
    script = script_text("commit")
    for table in (CLUSTER, RANK, WEIGHTS):
        for spec in table.transitions:
            for g in spec.guards:
                assert f"'{g.kind.value}'" in script
            if spec.effect is not Effect.NONE:
                assert f"'{spec.effect.value}'" in script
