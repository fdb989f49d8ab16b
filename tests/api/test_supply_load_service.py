"""``recv_expert_weight`` (:func:`fdeplb.api.service.supply_load`) when the store's transaction gives up under
contention: the :class:`ContentionError` surfaces (409, nothing written), never taken for a snapshot frozen
meanwhile, so the load is not supplied to the next round instead."""

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
