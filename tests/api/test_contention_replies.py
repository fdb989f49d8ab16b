"""The API under store contention: a :class:`ContentionError` (the store's transaction gave up, nothing written)
surfaces as the 409 it is from every route that refuses a state (``service.refuse_state``), never answered as a
refusal or taken for a snapshot frozen meanwhile (``recv_expert_weight`` does not re-target the next round)."""

from __future__ import annotations

import pytest

from fdeplb.api import service
from fdeplb.errors import ContentionError, http_status
from fdeplb.store import intents
from tests.helpers import RawRedis


@pytest.mark.parametrize("state", ["COLLECTING", "FREE"])
def test_a_contended_supply_is_a_409_and_not_retargeted(fired, redis_url, monkeypatch, state):
    store, raw = fired, RawRedis(redis_url, fired.cluster)
    raw.r.hset(raw.keys.rearrange, mapping={"state": state, "round": "2"})  # round 2's load not frozen yet
    rounds = []

    def lost_every_attempt(client, func, *watches, **kwargs):
        rounds.append(watches[0])
        raise ContentionError("gave up after 64 attempts: another writer changed it")

    monkeypatch.setattr(intents, "transaction", lost_every_attempt)
    before = raw.snapshot()
    with pytest.raises(ContentionError) as err:
        service.supply_load(store, [[1, 2, 3, 4]])
    assert http_status(err.value) == 409
    assert rounds == [raw.keys.snapshot(2 if state == "COLLECTING" else 3)]  # tried once, for its own round
    assert raw.snapshot() == before


def test_no_refusal_answers_a_contention():
    from fdeplb.errors import StateError

    assert service.refuse_state(StateError("weights are clearing")) == (400, {"code": 1, "msg": "weights are clearing"})
    with pytest.raises(ContentionError):
        service.refuse_state(ContentionError("gave up after 64 attempts"), "a round needs every rank's weights")


def test_a_contended_commit_is_a_409_not_a_refusal(fired, redis_url, monkeypatch):
    store, raw = fired, RawRedis(redis_url, fired.cluster)
    store.change_config({"cordoned": True}, actor="test")  # a commit is the operator's only while cordoned
    raw.r.hset(raw.keys.rearrange, mapping={"state": "LOAD_SUCC", "plan_id": "p1"})

    def lost_every_attempt(client, func, *watches, **kwargs):
        raise ContentionError("gave up after 64 attempts: another writer changed it")

    monkeypatch.setattr(intents, "transaction", lost_every_attempt)
    before = raw.snapshot()
    with pytest.raises(ContentionError):
        service.commit(store)  # was answered 400 "gave up ..." as if the commit were refused
    assert raw.snapshot() == before
