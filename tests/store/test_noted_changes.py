"""A change that an audit note records commits with its note in one step (``lua/audit.lua``, queued in the change's
WATCHed transaction): a withdrawn round request (:meth:`Store.withdraw_request`), a repaired member record
(:meth:`Store.repair_member`). A fenced-out caller, or a note that cannot be appended, changes nothing. The configuration's change is in tests/store/test_txn.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fdeplb.errors import FenceError, StoreError
from tests.helpers import RawRedis


@pytest.fixture
def pending(fired, redis_url):
    """The ``fired`` one-rank cluster, FREE, with round 2 requested and an operator's plan waiting for it."""
    store = fired
    store.request_round("test")
    store.supply_placement(store.current_placement().phy2log, {"kind": "operator", "plan_id": "p1"})
    return store, RawRedis(redis_url, store.cluster)


def test_a_withdrawal_and_its_note_commit_together(pending):
    store, raw = pending
    rec = store.read_cluster()
    withdrawn, audit_id, dropped = store.withdraw_request(None, trigger="request_cancelled", actor="op", reason="r",
                                                          detail={"by": "op"}, drop_supplied="operator")
    assert (withdrawn, dropped) == (2, {"kind": "operator", "plan_id": "p1"})
    note = store.audit()[-1]
    assert note.id == audit_id and (note["trigger"], note["actor"], note["reason"]) == ("request_cancelled", "op", "r")
    assert (note["from"], note["to"], note["version"], note["round"]) == ("FREE", "FREE", str(rec.version), "1")
    assert json.loads(note["detail"]) == {"by": "op", "round": 2, "requested_reason": "test",
                                          "dropped_supplied": {"kind": "operator", "plan_id": "p1"}}
    assert raw.r.get(raw.keys.audit_head).decode() == note["chain"]
    after = store.read_cluster()
    assert (after.requested, after.requested_ms) == (1, 0) and store.supplied_placement() is None


def test_a_fenced_out_withdrawal_changes_nothing(pending):
    store, raw = pending
    fence = store.lease_info().holder  # the one fire_round took
    before = raw.snapshot()
    with pytest.raises(FenceError, match="request_expired on cluster: fence someone-else is not the lease holder"):
        store.withdraw_request(2, trigger="request_expired", actor="coord-b", reason="r", fence="someone-else",
                               drop_supplied="operator")  # a deposed coordinator
    assert raw.snapshot() == before  # the request still pending, the plan still waiting, no note
    store.withdraw_request(2, trigger="request_expired", actor="coord-a", reason="r", fence=fence)  # the leader
    assert store.audit()[-1]["fence"] == fence and store.read_cluster().requested == 1


def test_a_withdrawal_whose_note_cannot_be_appended_changes_nothing(pending):
    store, raw = pending
    saved = raw.r.dump(raw.keys.audit)
    raw.r.delete(raw.keys.audit)
    raw.r.set(raw.keys.audit, "not a stream")  # the append (XADD) inside the commit fails with WRONGTYPE
    before = raw.snapshot()
    try:
        with pytest.raises(StoreError, match="WRONGTYPE"):
            store.withdraw_request(None, trigger="request_cancelled", actor="op", reason="r",
                                   drop_supplied="operator")
        assert raw.snapshot() == before  # no withdrawal without its audit record
    finally:
        raw.r.delete(raw.keys.audit)
        raw.r.restore(raw.keys.audit, 0, saved)
    assert store.read_cluster().requested == 2 and np.array_equal(
        store.supplied_placement()[0], store.current_placement().phy2log)


def test_a_member_repair_whose_note_cannot_be_appended_changes_nothing(fired, redis_url):
    store, raw = fired, RawRedis(redis_url, fired.cluster)
    key = raw.keys.member(0)
    raw.r.hset(key, mapping={"state": "BOGUS", "version": "0"})
    head = raw.r.get(raw.keys.audit_head)
    raw.r.delete(raw.keys.audit_head)
    raw.r.hset(raw.keys.audit_head, "not", "a string")  # the append inside the commit fails with WRONGTYPE
    before = raw.snapshot()
    try:
        with pytest.raises(StoreError, match="WRONGTYPE"):
            store.repair_member(0, fence="", actor="test")
        assert raw.snapshot() == before  # the record still corrupt: no rewrite without its audit record
    finally:
        raw.r.delete(raw.keys.audit_head)
        raw.r.set(raw.keys.audit_head, head)
    fixed = store.repair_member(0, fence="", actor="test")
    assert raw.r.hgetall(key) == {b"state": b"ACTIVE", b"version": b"0"} and fixed.source == "initial"
    assert store.audit()[-1].id == fixed.audit_id and store.audit()[-1]["chain"] == raw.r.get(
        raw.keys.audit_head).decode()
