"""GET /clear_load_weight answers 409 naming the ranks that held a cancelled request back."""

from __future__ import annotations

import pytest
import requests

from fdeplb.machines.tables import WeightState
from tests.api.test_api import _app
from tests.api_helpers import AUTH, served
from tests.helpers import thread_cluster
from tests.orchestration.test_weights_cancel import DEADLINES, embedded

pytestmark = pytest.mark.slow


def test_a_cancelled_clear_answers_409_naming_the_ranks(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path, deadlines=DEADLINES) as tc:
        with embedded(tc, serving=[0, 2]) as (_agents, _start), served(_app(tc, weights_timeout_s=60)) as url:
            tc.start_coordinator()
            r = requests.get(f"{url}/clear_load_weight", auth=AUTH)
            body = r.json()
            assert r.status_code == 409 and body["code"] == 1 and body["ranks"] == [1, 3], r.text
            assert "cancelled" in body["msg"] and "ranks [1, 3]" in body["msg"] and body["request"] == 1
            store = tc.store()
            assert [store.read_weights(r).state for r in range(4)] != [WeightState.CLEARED] * 4
