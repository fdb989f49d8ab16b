"""The HTTP API on loopback (uvicorn in a thread, requests, FastDeploy's request bodies), against real Redis."""

from __future__ import annotations

import json
import select
import socket
import threading

import numpy as np
import pytest
import requests

from fdeplb.api import ApiSettings, Credentials, create_app
from fdeplb.machines.tables import WEIGHTS, ClusterState, WeightState
from fdeplb.orchestration.handles import RecordHandle
from fdeplb.store import Store
from tests.api_helpers import AUTH, CREDS, PASSWORD, USER, app_of, served
from tests.helpers import RawRedis, thread_cluster, wait_for

pytestmark = pytest.mark.slow  # a thread cluster (coordinator + agents in threads) in every test


def _register(tc):
    store = tc.store()
    for r in range(tc.config.ep_size):
        store.register_rank(r, {**store.rank_info().get(r, {}), "api_address": f"10.0.0.{r + 1}:8000"})
    return [f"10.0.0.{r + 1}:8000" for r in range(tc.config.ep_size)]


def _round_done(store, n):
    rec = store.read_cluster()
    return rec.state is ClusterState.FREE and rec.round >= n and rec


def test_every_route_answers_in_fastdeploy_shape(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        tc.start()
        ips = _register(tc)
        store = tc.store()
        with served(app_of(tc)) as url:
            r = requests.post(f"{url}/rearrange_experts", json={**CREDS, "ips": ips})
            assert r.status_code == 200 and r.json()["code"] == 0, r.text
            assert r.json()["round"] == 1
            rec = wait_for(lambda: _round_done(store, 1), 60, store, "round 1 to finish")
            assert rec.plan_id or "gated" in rec.reason

            r = requests.post(f"{url}/check_redundant", json={**CREDS})
            assert r.status_code == 200 and r.json()["status"] == "FREE" and r.json()["code"] == 0
            r = requests.post(f"{url}/check_redundant", json={**CREDS, "action": "", "check_get_workloads": True})
            data = r.json()["data"]
            assert np.array_equal(data["ep_rank_to_expert_id_list"], store.current_placement().phy2log)
            assert np.array_equal(data["tokens_per_expert_stats_list"], store.read_snapshot(1))
            assert np.asarray(data["expert_in_rank_num_list"]).sum(axis=1).tolist() == \
                [tc.config.num_physical_experts] * tc.config.num_layers
            r = requests.post(f"{url}/check_redundant", json={**CREDS, "action": "check_load_weight_result"})
            assert r.status_code == 200 and r.json()["data"] == [0] * tc.config.ep_size  # round over: ranks IDLE

            r = requests.post(f"{url}/get_per_expert_tokens_stats", json={**CREDS})
            assert r.status_code == 200
            assert np.array_equal(np.asarray(r.json()["data"]), tc.loads)
            r = requests.post(f"{url}/get_per_expert_tokens_stats", json={**CREDS, "clear_stat": True})
            assert r.status_code == 200 and "clear_stat" in r.json()["msg"]

            r = requests.get(f"{url}/health", auth=AUTH)
            assert r.status_code == 200 and r.json() == {"code": 0, "msg": "ok", "ranks": tc.config.ep_size}

            state = requests.get(f"{url}/v1/state", auth=AUTH).json()
            assert state["rearrange"]["state"] == "FREE" and state["rearrange"]["round"] == 1
            assert state["api_addresses"]["0"] == ips[0]
            audit = requests.get(f"{url}/v1/audit", auth=AUTH).json()
            assert len(audit["records"]) == RawRedis(redis_url, cluster_id).audit_len()
            tail = requests.get(f"{url}/v1/audit", params={"since": audit["records"][-3]["id"], "limit": 1},
                                auth=AUTH).json()
            assert [x["id"] for x in tail["records"]] == [audit["records"][-2]["id"]]

            pl = requests.get(f"{url}/v1/placement", auth=AUTH).json()
            assert np.array_equal(pl["phy2log"], store.current_placement().phy2log)
            assert np.asarray(pl["logcnt"]).shape == (tc.config.num_layers, tc.config.num_logical_experts)
            for fmt in ("sglang", "fastdeploy", "trtllm", "fdeplb"):
                r = requests.get(f"{url}/v1/placement", params={"format": fmt}, auth=AUTH)
                assert r.status_code == 200 and r.text, fmt
            r = requests.get(f"{url}/v1/statecharts/cluster.svg", auth=AUTH)
            assert r.status_code == 200 and "<svg" in r.text and r.headers["content-type"].startswith("image/svg")
            assert requests.get(f"{url}/v1/statecharts/nope.svg", auth=AUTH).status_code == 404

            text = requests.get(f"{url}/metrics", auth=AUTH).text
            assert 'fdeplb_transitions_total{from="FREE",machine="cluster",to="COLLECTING"} 1.0' in text
            assert "fdeplb_round_duration_seconds_count 1.0" in text
            assert 'fdeplb_heartbeat_age_seconds{ep_rank="0"}' in text
            assert "fdeplb_up 1.0" in text
            if rec.plan_id:
                plan = store.read_plan(rec.plan_id)
                assert f"fdeplb_moved_experts {float(plan.moved_experts)}" in text


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/rearrange_experts", {"ips": ["10.0.0.1:8000"]}),
    ("POST", "/rearrange_experts", {"action": "recv_expert_weight", "data": [[1]]}),
    ("POST", "/rearrange_experts", {"action": "update_weight_from_tensor"}),
    ("POST", "/get_per_expert_tokens_stats", {"clear_stat": True}),
    ("POST", "/check_redundant", {}),
    ("GET", "/update_model_weight", None), ("GET", "/clear_load_weight", None),  # /health is open: test_open_health
    ("GET", "/v1/state", None), ("GET", "/v1/audit", None), ("GET", "/v1/placement", None),
    ("GET", "/v1/statecharts/cluster.svg", None), ("GET", "/metrics", None),
])
def test_wrong_or_missing_credentials_401_and_nothing_changes(redis_url, cluster_id, tmp_path, method, path, body):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        _register(tc)
        raw = RawRedis(redis_url, cluster_id)
        before = raw.snapshot()
        with served(app_of(tc)) as url:
            attempts = ([{}, {"user": USER}, {"user": USER, "passwd": PASSWORD + "x"}, {"user": 1, "passwd": [2]},
                         {"user": USER.upper(), "passwd": PASSWORD}] if method == "POST" else
                        [None, (USER, "wrong"), ("", ""), (USER, PASSWORD[:-1])])
            for cred in attempts:
                if method == "POST":
                    r = requests.post(url + path, json={**body, **cred})
                else:
                    r = requests.get(url + path, auth=cred)
                    assert r.headers.get("www-authenticate", "").startswith("Basic")
                assert r.status_code == 401, (cred, r.text)
                assert r.json() == {"code": 1, "msg": "user or passwd is invalid"}
            r = requests.get(url + path, headers={"Authorization": "Basic !!!notbase64"})
            assert r.status_code in (401, 405)
        assert raw.snapshot() == before


def test_unregistered_ips_are_refused_and_never_contacted(redis_url, cluster_id, tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    trap = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
            ips = _register(tc)
            raw = RawRedis(redis_url, cluster_id)
            before = raw.snapshot()
            with served(app_of(tc)) as url:
                r = requests.post(f"{url}/rearrange_experts", json={**CREDS, "ips": [ips[0], trap, "evil:1"]})
                assert r.status_code == 400 and r.json()["code"] == 1
                assert trap in r.json()["msg"] and "evil:1" in r.json()["msg"] and ips[0] not in r.json()["msg"]
                for body in ({**CREDS}, {**CREDS, "ips": []}, {**CREDS, "ips": [trap] * 5000}):
                    r = requests.post(f"{url}/rearrange_experts", json=body)
                    assert r.status_code == 400, r.text
            assert raw.snapshot() == before
            readable, _, _ = select.select([listener], [], [], 0)  # the replies came: any connection is queued now
            assert readable == [], "the API connected to an address from the request"
    finally:
        listener.close()


def test_busy_start_is_refused_in_fastdeploy_shape(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        ips = _register(tc)
        raw = RawRedis(redis_url, cluster_id)
        with served(app_of(tc)) as url:
            assert requests.post(f"{url}/rearrange_experts", json={**CREDS, "ips": ips}).status_code == 200
            before = raw.snapshot()
            r = requests.post(f"{url}/rearrange_experts", json={**CREDS, "ips": ips})
            assert r.status_code == 400 and r.json()["msg"].startswith("rearrange is doing. actual status 0")
            raw.force(raw.keys.rearrange, "LOADING", requested="1", round="1")
            before = raw.snapshot()
            r = requests.post(f"{url}/rearrange_experts", json={**CREDS, "ips": ips})
            assert r.status_code == 400 and r.json()["msg"].startswith("rearrange is doing. actual status 1")
            r = requests.post(f"{url}/rearrange_experts", json={**CREDS, "action": "update_weight_from_tensor"})
            assert r.status_code == 400 and "expect status 2" in r.json()["msg"]
            r = requests.post(f"{url}/rearrange_experts", json={**CREDS, "action": "shuffle"})
            assert r.status_code == 400 and r.json() == {"code": 1, "msg": "invalid action shuffle"}
            r = requests.post(f"{url}/check_redundant", json={**CREDS, "action": "shuffle"})
            assert r.status_code == 400
            r = requests.post(f"{url}/check_redundant", json={**CREDS})
            assert r.json()["status"] == "DOING"
            assert raw.snapshot() == before


def test_cordoned_round_commits_with_update_weight_from_tensor(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path, cordoned=True) as tc:
        tc.start()
        ips = _register(tc)
        store = tc.store()
        with served(app_of(tc)) as url:
            assert requests.post(f"{url}/rearrange_experts", json={**CREDS, "ips": ips}).status_code == 200
            wait_for(lambda: store.read_cluster().state is ClusterState.LOAD_SUCC, 60, store, "LOAD_SUCC")
            r = requests.post(f"{url}/check_redundant", json={**CREDS})
            assert r.json()["status"] == "LOAD_SUCC"
            r = requests.post(f"{url}/check_redundant", json={**CREDS, "action": "check_load_weight_result"})
            assert r.json()["data"] == [1] * tc.config.ep_size
            plan_id = store.read_cluster().plan_id
            r = requests.post(f"{url}/rearrange_experts", json={**CREDS, "action": "update_weight_from_tensor"})
            assert r.status_code == 200 and r.json()["plan_id"] == plan_id
            wait_for(lambda: _round_done(store, 1), 60, store, "the committed round to finish")
            assert store.current_placement().plan_id == plan_id
            (commit,) = [a for a in store.iter_audit() if a["trigger"] == "commit"]
            assert commit["reason"] == "external commit requested by http"


def test_supplied_load_is_the_next_rounds_snapshot(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        tc.start()
        ips = _register(tc)
        store = tc.store()
        L, E = tc.config.num_layers, tc.config.num_logical_experts
        supplied = (np.arange(L * E).reshape(L, E) % 7 + 1) * 1000
        supplied[:, 0] = 2**40
        with served(app_of(tc)) as url:
            r = requests.post(f"{url}/rearrange_experts",
                              json={**CREDS, "action": "recv_expert_weight", "data": supplied.tolist()})
            assert r.status_code == 200 and r.json() == {"code": 0, "msg": "ok", "round": 1}
            assert requests.post(f"{url}/rearrange_experts", json={**CREDS, "ips": ips}).status_code == 200
            wait_for(lambda: _round_done(store, 1), 60, store, "round 1")
            assert np.array_equal(store.read_snapshot(1), supplied)


def _hostile_loads(L, E):
    good = [[1] * E for _ in range(L)]
    return {
        "negative": [[-1] * E for _ in range(L)],
        "2**63": [[2**63] * E for _ in range(L)],
        "float": [[1.5] * E for _ in range(L)],
        "string": [["1"] * E for _ in range(L)],
        "bool": [[True] * E for _ in range(L)],
        "ragged": good[:-1] + [[1] * (E - 1)],
        "short": good[:-1],
        "3-D": [good],
        "scalar": 5,
        "oversized": [[1] * (E + 1) for _ in range(L)],
        "huge": [[1] * 70_000],
    }


def test_hostile_input_is_4xx_one_line_and_changes_nothing(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        _register(tc)
        raw = RawRedis(redis_url, cluster_id)
        before = raw.snapshot()
        L, E = tc.config.num_layers, tc.config.num_logical_experts
        app = create_app(tc.store(), Credentials(USER, PASSWORD), ApiSettings(max_body_bytes=1 << 20))
        with served(app) as url:
            def post(path, raw_body, content_type="application/json"):
                return requests.post(url + path, data=raw_body, headers={"Content-Type": content_type})

            cases = []
            for name, data in _hostile_loads(L, E).items():
                cases.append(("/rearrange_experts", json.dumps({**CREDS, "action": "recv_expert_weight",
                                                               "data": data})))
            for path in ("/rearrange_experts", "/check_redundant", "/get_per_expert_tokens_stats"):
                cases += [
                    (path, b"{not json"), (path, b"[1, 2]"), (path, b'"text"'), (path, b"\xff\xfe"),
                    (path, json.dumps({**CREDS, "unknown_field": 1})),
                    (path, json.dumps({**CREDS, "action": 7})),
                    (path, json.dumps({**CREDS, "clear_stat": "yes"})),
                    (path, json.dumps({**CREDS, "check_get_workloads": 1})),
                    (path, json.dumps({**CREDS, "ips": "10.0.0.1:8000"})),
                    (path, json.dumps({**CREDS, "ips": [None]})),
                    (path, json.dumps({**CREDS, "data": [[1]]}).replace("1", "NaN", 1)),
                    (path, '{"user": "operator", "passwd": "' + PASSWORD + '", "x": ' + "[" * 5000 + "]" * 5000
                     + "}"),
                    (path, '{"user": "operator", "passwd": "' + PASSWORD + '", "x": ' + "[" * 20 + "]" * 20 + "}"),
                    (path, json.dumps({**CREDS, "pad": "x" * (2 << 20)})),
                    (path, '{"user": "operator", "passwd": "' + PASSWORD + '", "n": 1' + "0" * 5000 + "}"),
                ]
            for path, body in cases:
                r = post(path, body)
                assert 400 <= r.status_code < 500, (path, str(body)[:80], r.status_code, r.text[:200])
                msg = r.json()["msg"]
                assert r.json()["code"] == 1 and "\n" not in msg and 0 < len(msg) < 400, msg
            for path, params in [("/v1/audit", {"since": "x"}), ("/v1/audit", {"limit": "-1"}), ("/v1/audit", {"limit": "0"}),
                                 ("/v1/audit", {"limit": "10001"}), ("/v1/audit", {"limit": "2.5"}),
                                 ("/v1/audit", {"limit": "10000000000"}), ("/v1/audit", {"wait_ms": "1e9"}),
                                 ("/v1/placement", {"format": "csv"}), ("/v1/audit", {"since": "1-1-1"}),
                                 # stream ids past 2**64 - 1, non-ASCII digits, a trailing newline: Redis refused
                                 # them with a 500; the limit took Arabic-Indic digits as 12
                                 ("/v1/audit", {"since": "99999999999999999999-0"}),
                                 ("/v1/audit", {"since": "0-18446744073709551616"}),
                                 ("/v1/audit", {"since": "\u0661-\u0662"}), ("/v1/audit", {"since": "1-2\n"}),
                                 ("/v1/audit", {"limit": "\u0661\u0662"}), ("/v1/audit", {"wait_ms": "\u0661"})]:
                r = requests.get(url + path, params=params, auth=AUTH)
                assert r.status_code == 400 and r.json()["code"] == 1, (path, params, r.text)
            assert requests.put(f"{url}/rearrange_experts", auth=AUTH).status_code == 405
            assert requests.get(f"{url}/nowhere", auth=AUTH).status_code == 404
        assert raw.snapshot() == before


def _weights_agent(store: Store, stop: threading.Event, ep_size: int) -> None:
    """What a rank agent does with a weight request (the issue-11 contract): request n, carried out once, through
    the weight-status machine, recording ``request`` = n on the final transition."""
    handles = [RecordHandle(store, WEIGHTS, r, actor=f"test-weights{r}") for r in range(ep_size)]
    cursor = store.cursor()
    while not stop.is_set():
        rec = store.read_cluster()
        for h in handles:
            w = h.read()
            if rec.weights_request > w.request:
                step = ("clear", "cleared") if rec.weights_action == "clear" else ("update", "updated")
                h.fire(step[0], record=w)
                h.fire(step[1], changes={"request": rec.weights_request})
        store.wait(cursor, 200)


def test_clear_then_update_over_http(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        ips = _register(tc)
        store = tc.store()
        with served(app_of(tc, weights_timeout_s=60)) as url:
            r = requests.get(f"{url}/update_model_weight", auth=AUTH)
            assert r.status_code == 200 and r.json()["msg"] == "model weight is updated"  # nothing to do
            stop = threading.Event()
            agent = threading.Thread(target=_weights_agent, args=(tc.store(), stop, tc.config.ep_size), daemon=True)
            agent.start()
            try:
                r = requests.get(f"{url}/clear_load_weight", auth=AUTH)
                assert r.status_code == 200 and r.json()["msg"] == "clear model weight successfully", r.text
                assert {w.state for w in store.read_all(WEIGHTS)} == {WeightState.CLEARED}
                r = requests.post(f"{url}/rearrange_experts", json={**CREDS, "ips": ips})
                assert r.status_code == 400 and "not NORMAL" in r.json()["msg"]
                r = requests.get(f"{url}/update_model_weight", auth=AUTH)
                assert r.status_code == 200 and r.json()["msg"] == "update model weight successfully", r.text
                assert {w.state for w in store.read_all(WEIGHTS)} == {WeightState.NORMAL}
            finally:
                stop.set()
                agent.join(timeout=10)


def test_weight_request_times_out_with_404_when_no_rank_carries_it_out(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        with served(app_of(tc, weights_timeout_s=0.5)) as url:
            r = requests.get(f"{url}/clear_load_weight", auth=AUTH)
            assert r.status_code == 404 and r.json()["code"] == 1 and "timeout" in r.json()["msg"]
            assert store.read_cluster().weights_request == 1 and store.read_cluster().weights_action == "clear"


def test_health_reports_stale_heartbeats_503(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        with served(app_of(tc)) as url:
            r = requests.get(f"{url}/health", auth=AUTH)  # no rank registered (it said 200, "ranks": 0)
            assert r.status_code == 503 and "rank 3 not registered" in r.json()["msg"], r.text
            for rank in range(tc.config.ep_size):
                store.register_rank(rank, {"api_address": f"10.0.0.{rank}:8000"})
                if rank:
                    store.heartbeat(rank)
            r = requests.get(f"{url}/health", auth=AUTH)
            assert r.status_code == 503 and "ranks [0]" in r.json()["msg"] and "never beat" in r.json()["msg"]
            store.heartbeat(0)
            assert requests.get(f"{url}/health", auth=AUTH).status_code == 200
    app = create_app(Store("redis://127.0.0.1:1/0", "gone"), Credentials(USER, PASSWORD))
    with served(app) as url:
        r = requests.get(f"{url}/health", auth=AUTH)
        assert r.status_code == 503 and r.json()["code"] == 1
        assert requests.get(f"{url}/metrics", auth=AUTH).status_code == 200  # fdeplb_up 0, not a 500


def test_long_polls_have_their_own_threads_and_leave_health_answering(redis_url, cluster_id, tmp_path, monkeypatch):
    """50 pending long-polls (more than the 40 threads every other route shares) used to leave /health unanswered
    until they ended; now they take at most ``max_waiting`` threads of their own and queue for them."""
    from fdeplb.api import service

    release, entered, lock = threading.Event(), [0], threading.Lock()

    def pending_audit(*_args):  # a long-poll that nothing answers until the test says so
        with lock:
            entered[0] += 1
        release.wait(120)
        return {"records": []}

    monkeypatch.setattr(service, "audit", pending_audit)
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc, served(app_of(tc, max_waiting=4)) as url:
        answers: list[int] = []
        polls = [threading.Thread(target=lambda: answers.append(requests.get(
            f"{url}/v1/audit", params={"wait_ms": "30000"}, auth=AUTH, timeout=180).status_code)) for _ in range(50)]
        try:
            for t in polls:
                t.start()
            wait_for(lambda: entered[0] >= 4, 60, what="4 long-polls in their threads")
            health = requests.get(f"{url}/health", auth=AUTH, timeout=60)  # answered while all 50 are pending
            assert health.status_code in (200, 503) and "code" in health.json(), health.text
            assert entered[0] == 4 and not answers  # the other 46 wait for one of the 4 threads, not for others'
        finally:
            release.set()
            for t in polls:
                t.join(timeout=120)
        assert answers == [200] * 50


def test_a_weight_clear_racing_a_start_never_leaves_an_accepted_round_waiting_on_cleared_weights(
        redis_url, cluster_id, tmp_path):
    """A start is only accepted with every rank's weights loaded, and a clear only with no round running or pending,
    each checked in the transaction that writes the request: a clear taken between the start's weight check and its
    request used to be accepted too, and once the ranks cleared, the accepted round waited for an update (found by
    the QA pass). Either order of the two requests now refuses the second and writes nothing for it."""
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        ips = _register(tc)
        store, raw = tc.store(), RawRedis(redis_url, cluster_id)
        with served(create_app(store, Credentials(USER, PASSWORD), ApiSettings(weights_timeout_s=0.5))) as url:
            # a clear asked between the start's weight check and its request: the start is refused
            request_round_if_free = store.request_round_if_free

            def clear_first(*args, **kwargs):
                tc.store().request_weights("clear", "racing clear")
                return request_round_if_free(*args, **kwargs)

            store.request_round_if_free = clear_first
            r = requests.post(f"{url}/rearrange_experts", json={**CREDS, "ips": ips})
            assert r.status_code == 400 and "weight" in r.json()["msg"], r.text
            rec = store.read_cluster()
            assert rec.requested == rec.round == 0 and rec.weights_request == 1
            # the ranks carry out the clear and update again (no round pending: nothing waits)
            stop = threading.Event()
            agent = threading.Thread(target=_weights_agent, args=(tc.store(), stop, tc.config.ep_size), daemon=True)
            agent.start()
            try:
                wait_for(lambda: all(w.request == 1 for w in store.read_all(WEIGHTS)), 30, store, "clear 1")
                store.request_weights("update", "test")
                wait_for(lambda: all(w.request == 2 and w.state is WeightState.NORMAL
                                     for w in store.read_all(WEIGHTS)), 30, store, "update 2")
            finally:
                stop.set()
                agent.join(timeout=10)
            store.request_round_if_free = request_round_if_free
            # a round accepted (pending: no coordinator runs), then a clear: the clear is refused
            assert requests.post(f"{url}/rearrange_experts", json={**CREDS, "ips": ips}).status_code == 200
            before = raw.snapshot()
            r = requests.get(f"{url}/clear_load_weight", auth=AUTH)
            assert r.status_code == 400 and "round" in r.json()["msg"], r.text
            assert raw.snapshot() == before and store.read_cluster().weights_request == 2
