"""GET /clear_load_weight answers 409 naming the ranks that held a cancelled request back."""

from __future__ import annotations

import pytest
import requests

from fdeplb.machines.tables import WeightState
from tests.api_helpers import AUTH, app_of, served
from tests.helpers import thread_cluster, wait_for
from tests.orchestration.helpers import CANCEL_DEADLINES, embedded

pytestmark = pytest.mark.slow


def test_a_cancelled_clear_answers_409_naming_the_ranks(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path, deadlines=CANCEL_DEADLINES) as tc:
        with embedded(tc, serving=[0, 2]) as (_agents, _start), served(app_of(tc, weights_timeout_s=60)) as url:
            tc.start_coordinator()
            r = requests.get(f"{url}/clear_load_weight", auth=AUTH)
            body = r.json()
            assert r.status_code == 409 and body["code"] == 1 and body["ranks"] == [1, 3], r.text
            assert "cancelled" in body["msg"] and "ranks [1, 3]" in body["msg"] and body["request"] == 1
            store = tc.store()
            # the withdrawn clear takes every rank back (each rank's own cancel, CLEARING -> NORMAL): nobody cleared
            wait_for(lambda: all(store.read_weights(r).state is not WeightState.CLEARING for r in range(4)), 30, store,
                     "every rank's cancel")
            assert [store.read_weights(r).state for r in range(4)] == [WeightState.NORMAL] * 4
