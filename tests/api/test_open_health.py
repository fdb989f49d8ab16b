"""``/health`` answers without credentials, as FastDeploy's and vLLM's do for probes: 200 on a healthy
cluster, 503 with one phrase on an unhealthy one, and nothing else of the cluster; ``/metrics`` stays behind
credentials unless ``metrics_public`` (``fdeplb serve --metrics-public``); every other route still 401."""

from __future__ import annotations

import pytest
import requests

from fdeplb.api import Credentials, create_app
from fdeplb.api.service import HEALTH_PHRASES
from fdeplb.store import Store
from tests.api_helpers import AUTH, PASSWORD, USER, app_of, served
from tests.helpers import RawRedis, thread_cluster, wait_for

OTHER_GETS = ("/update_model_weight", "/clear_load_weight", "/v1/state", "/v1/audit", "/v1/placement",
              "/v1/statecharts/cluster.svg")


def test_health_is_open_200_then_503_with_one_phrase_when_a_rank_goes_stale(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        tc.start_agents(heartbeat_ttl_ms=1_000)
        wait_for(lambda: not store.stale_ranks() and len(store.rank_info()) == tc.config.ep_size, 30, store,
                 "every rank registered and beating")
        with served(app_of(tc)) as url:
            for auth in (None, (USER, "wrong")):  # a probe: no credentials, or stale ones
                r = requests.get(f"{url}/health", auth=auth)
                assert r.status_code == 200, r.text
                assert r.json() == {"code": 0, "msg": "ok"}  # no rank count, no cluster data
                assert "www-authenticate" not in r.headers
            assert requests.get(f"{url}/health", auth=AUTH).json()["ranks"] == tc.config.ep_size  # operators: more
            tc.agents[2].stop_event.set()
            tc.threads[2].join(10)
            wait_for(lambda: 2 in store.stale_ranks(), 30, store, "rank 2 stale")
            r = requests.get(f"{url}/health")
            assert r.status_code == 503 and r.json() == {"code": 1, "msg": HEALTH_PHRASES["ranks"]}, r.text
            r = requests.get(f"{url}/health", auth=AUTH)
            assert r.status_code == 503 and "ranks [2]" in r.json()["msg"]  # with credentials: which, and why


def test_health_without_redis_is_503_redis_unavailable_and_names_no_url():
    app = create_app(Store("redis://127.0.0.1:1/0", "gone"), Credentials(USER, PASSWORD))
    with served(app) as url:
        r = requests.get(f"{url}/health")
        assert r.status_code == 503 and r.json() == {"code": 1, "msg": "Redis unavailable"}, r.text


def test_health_answers_503_in_time_when_redis_is_frozen(monkeypatch):
    # QA: with redis-server stopped (SIGSTOP) /health answered after the 30 s socket timeout; a probe gives up sooner
    import socket

    from fdeplb.api import service

    monkeypatch.setattr(service, "HEALTH_DEADLINE_S", 0.5)
    silent = socket.socket()  # accepts connections and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    app = create_app(Store(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", "frozen"), Credentials(USER, PASSWORD))
    try:
        with served(app) as url:
            for auth in (None, AUTH):
                r = requests.get(f"{url}/health", auth=auth, timeout=20)  # the socket timeout is 30 s
                assert r.status_code == 503 and r.json() == {"code": 1, "msg": "Redis unavailable"}, r.text
    finally:
        silent.close()


@pytest.mark.parametrize("public", [False, True])
def test_metrics_needs_credentials_unless_public_and_every_other_route_still_401(redis_url, cluster_id, tmp_path,
                                                                                public):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        raw = RawRedis(redis_url, cluster_id)
        before = raw.snapshot()
        with served(app_of(tc, metrics_public=public)) as url:
            r = requests.get(f"{url}/metrics")
            if public:
                assert r.status_code == 200 and "fdeplb_up 1.0" in r.text
            else:
                assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
            assert requests.get(f"{url}/metrics", auth=AUTH).status_code == 200
            for path in OTHER_GETS:
                r = requests.get(url + path)
                assert r.status_code == 401 and r.json() == {"code": 1, "msg": "user or passwd is invalid"}, path
            for path in ("/rearrange_experts", "/get_per_expert_tokens_stats", "/check_redundant"):
                assert requests.post(url + path, json={}).status_code == 401, path
        assert raw.snapshot() == before
