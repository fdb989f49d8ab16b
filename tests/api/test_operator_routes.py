"""fdeplb's operator routes (``/v1/round/abort|cancel``, ``/v1/config``, ``/v1/cluster/delete``) and the HTTP commit
that names its plan (``update_weight_from_tensor`` with ``plan_id``), on loopback against a real Redis: HTTP Basic,
audited as ``http:<user>``, a verb that cannot apply a 409 with nothing written."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import requests

from fdeplb.api import ApiSettings, Credentials, create_app
from fdeplb.machines.tables import ClusterState
from fdeplb.orchestration.cluster_setup import init_cluster
from fdeplb.store import ClusterConfig, Store
from tests.api_helpers import AUTH, CREDS, PASSWORD, USER, served
from tests.helpers import RawRedis


@pytest.fixture
def store(redis_url, cluster_id):
    store = Store(redis_url, cluster_id)
    init_cluster(store, ClusterConfig(num_layers=1, num_logical_experts=4, num_physical_experts=6, ep_size=3,
                                      cordoned=True), np.array([[0, 1, 2, 3, 0, 1]], dtype=np.int64))
    yield store
    store.delete_cluster()


@pytest.fixture
def url(store):
    with served(create_app(Store(store.url, store.cluster), Credentials(USER, PASSWORD), ApiSettings())) as base:
        yield base


def test_round_cancel_and_abort_over_http_are_audited_with_the_caller(store, url, redis_url):
    r = requests.post(f"{url}/v1/round/cancel", json={"reason": "x"})
    assert r.status_code == 401  # Basic, as every route but /health
    r = requests.post(f"{url}/v1/round/cancel", json={"reason": "x"}, auth=AUTH)
    assert r.status_code == 409 and "no round request is pending" in r.json()["msg"]
    store.request_round("test")
    r = requests.post(f"{url}/v1/round/cancel", json={"reason": "not needed"}, auth=AUTH)
    assert r.status_code == 200 and r.json()["round"] == 1, r.text
    note = store.audit()[-1]
    assert (note["trigger"], note["actor"]) == ("request_cancelled", f"http:{USER}")

    raw = RawRedis(redis_url, store.cluster)
    raw.force(raw.keys.rearrange, ClusterState.SWAPPING, version=3, round="1", plan_id="p1")
    before = raw.snapshot()
    r = requests.post(f"{url}/v1/round/abort", json={}, auth=AUTH)
    assert r.status_code == 409 and "past the commit point" in r.json()["msg"]
    assert raw.snapshot() == before
    raw.force(raw.keys.rearrange, ClusterState.LOADING, version=4, round="1", plan_id="p1")
    r = requests.post(f"{url}/v1/round/abort", json={"reason": "bad plan"}, auth=AUTH)
    assert r.status_code == 200 and r.json()["state_was"] == "LOADING", r.text
    last = store.audit()[-1]
    assert (last["trigger"], last["actor"], last["to"]) == ("operator_abort", f"http:{USER}", "FREE")
    r = requests.post(f"{url}/v1/round/abort", json={"reason": 7}, auth=AUTH)
    assert r.status_code == 400 and "reason" in r.json()["msg"]


def test_config_over_http_changes_only_the_settable(store, url):
    r = requests.post(f"{url}/v1/config", json={"min_gain": 0.1, "deadlines": {"commit_ms": 5000}}, auth=AUTH)
    assert r.status_code == 200 and r.json()["version"] == 1, r.text
    assert requests.get(f"{url}/v1/config", auth=AUTH).json()["deadlines"]["commit_ms"] == 5000
    note = store.audit()[-1]
    assert note["actor"] == f"http:{USER}"
    assert json.loads(note["detail"])["changes"] == {"min_gain": [0.0, 0.1], "deadlines.commit_ms": [600000, 5000]}
    r = requests.post(f"{url}/v1/config", json={"num_layers": 2}, auth=AUTH)
    assert r.status_code == 400 and "num_layers" in r.json()["msg"]
    r = requests.post(f"{url}/v1/config", json={"policy": "nope"}, auth=AUTH)
    assert r.status_code == 400 and "unknown policy" in r.json()["msg"]
    assert store.read_config(fresh=True).version == 1


@pytest.mark.parametrize("path", ["/etc/passwd", "/dev/null", "new", "../escape.jsonl", "", None])
def test_config_over_http_never_sets_the_audit_export_path(store, url, redis_url, tmp_path, path):
    path = str(tmp_path / path) if path in ("new", "../escape.jsonl") else path
    raw, before = RawRedis(redis_url, store.cluster), store.read_config(fresh=True)
    snapshot, passwd = raw.snapshot(), os.stat("/etc/passwd")
    body = {"min_gain": 0.2, "audit_keep": 1, "audit_export_path": path, "reason": "hostile"}
    r = requests.post(f"{url}/v1/config", json=body, auth=AUTH)
    msg = r.json()["msg"]
    assert r.status_code == 400 and msg.startswith("audit_export_path, audit_keep cannot be changed over the API")
    assert "--audit-dir" in msg
    assert store.read_config(fresh=True) == before and raw.snapshot() == snapshot  # nor min_gain, nor audit_keep
    assert os.stat("/etc/passwd").st_mtime_ns == passwd.st_mtime_ns and os.listdir(tmp_path) == []
    assert path in (None, "", "/etc/passwd", "/dev/null") or not os.path.exists(path)


@pytest.mark.parametrize("keep", [3, 0, None])
def test_config_over_http_never_sets_audit_keep(store, url, redis_url, keep):
    # QA MED 1: whether a coordinator starts with audit_keep > 0 depends on its --audit-dir, which the API is not given
    raw = RawRedis(redis_url, store.cluster)
    snapshot = raw.snapshot()
    r = requests.post(f"{url}/v1/config", json={"audit_keep": keep, "reason": "qa"}, auth=AUTH)
    assert r.status_code == 400 and r.json()["msg"].startswith("audit_keep cannot be changed over the API"), r.text
    assert "config set --audit-keep" in r.json()["msg"] and raw.snapshot() == snapshot


def test_cluster_delete_over_http_is_refused_while_a_coordinator_leads(store, url):
    store.acquire_lease("lead@test", 60_000)
    r = requests.post(f"{url}/v1/cluster/delete", json={}, auth=AUTH)
    assert r.status_code == 409 and "holds the lease" in r.json()["msg"] and store.key_count() > 0
    r = requests.post(f"{url}/v1/cluster/delete", json={"force": True}, auth=AUTH)
    assert r.status_code == 200 and r.json()["deleted_keys"] > 0 and store.key_count() == 0


def test_update_weight_from_tensor_commits_only_the_plan_it_names(store, url, redis_url):
    raw = RawRedis(redis_url, store.cluster)
    raw.force(raw.keys.rearrange, ClusterState.LOAD_SUCC, version=4, round="2", plan_id="newplan")
    before = raw.snapshot()
    body = {**CREDS, "action": "update_weight_from_tensor", "plan_id": "reviewed"}
    r = requests.post(f"{url}/rearrange_experts", json=body)
    assert r.status_code == 409 and "plan reviewed is not the staged plan" in r.json()["msg"]
    assert "newplan" in r.json()["msg"] and raw.snapshot() == before  # nothing committed
    r = requests.post(f"{url}/rearrange_experts", json={**body, "plan_id": "newplan"})
    assert r.status_code == 200 and r.json()["plan_id"] == "newplan", r.text
    rec = store.read_cluster()
    assert (rec.commit_requested, rec.commit_requested_by) == ("newplan", "http")
    raw.force(raw.keys.rearrange, ClusterState.FREE, version=5, round="2", plan_id="newplan")
    r = requests.post(f"{url}/rearrange_experts", json={**body, "plan_id": "newplan"})  # its round timed out
    assert r.status_code == 409 and r.json()["msg"].startswith("plan newplan is not the staged plan: the cluster "
                                                               "is FREE (round 2), staged plan none")


def test_round_plan_over_http_supplies_the_plan_or_refuses_with_nothing_written(store, url, redis_url):
    """``POST /v1/round/plan`` (``rearrange --plan``'s twin): a plan of another shape or one lacking an expert is a
    400, one while a round is in flight a 409, nothing written; a good one is supplied for the round it answers,
    as an operator's plan with its routing digest."""
    from fdeplb.placement.digest import routing_digest
    from fdeplb.rounds import reasons

    raw = RawRedis(redis_url, store.cluster)
    before = raw.snapshot()
    for plan, words in (([[0, 1, 2, 3]], "shape (1, 4)"), ([[0, 1, 2, 0, 1, 2]], "without a replica")):
        r = requests.post(f"{url}/v1/round/plan", json={"phy2log": plan}, auth=AUTH)
        assert r.status_code == 400 and words in r.json()["msg"], r.text
    r = requests.post(f"{url}/v1/round/plan", json={"phy2log": [[0, 1, "x"]]}, auth=AUTH)
    assert r.status_code in (400, 422), r.text
    for plan, words in (([[0, 1, 2, 3, 0, 1], [0, 1]], "phy2log"), ([[10 ** 30] * 6], "phy2log")):  # not a 500
        r = requests.post(f"{url}/v1/round/plan", json={"phy2log": plan}, auth=AUTH)
        assert r.status_code == 400 and words in r.json()["msg"], r.text
    assert raw.snapshot() == before
    plan = [[2, 3, 0, 1, 2, 3]]
    r = requests.post(f"{url}/v1/round/plan", json={"phy2log": plan, "reason": "offline plan"}, auth=AUTH)
    digest = routing_digest(np.array(plan))
    assert r.status_code == 200 and r.json()["round"] == 1 and r.json()["plan"] == digest, r.text
    supplied, facts = store.supplied_placement()
    assert supplied.tolist() == plan and reasons.supplied_of({"supplied": facts})["plan_id"] == digest
    assert facts["why"] == f"POST /v1/round/plan by http:{USER} (offline plan)"
    r = requests.post(f"{url}/v1/round/plan", json={"phy2log": plan}, auth=AUTH)
    assert r.status_code == 409 and "waits for the next round" in r.json()["msg"], r.text


def test_round_plan_with_a_reason_the_request_refuses_supplies_nothing(store, url, redis_url):
    """QA: a reason with a control character was refused (400) by the round's request only after the plan was
    supplied: the plan stayed, and the coordinator's FREE work failed every pass requesting its round with that
    text (which no request may hold). Now it is refused first: 400, nothing written."""
    raw = RawRedis(redis_url, store.cluster)
    before = raw.snapshot()
    r = requests.post(f"{url}/v1/round/plan", json={"phy2log": [[2, 3, 0, 1, 2, 3]], "reason": "a\u0000b"}, auth=AUTH)
    assert r.status_code == 400 and "control characters" in r.json()["msg"], r.text
    assert raw.snapshot() == before and store.supplied_placement() is None


def test_a_body_with_a_key_given_twice_is_a_400_and_changes_nothing(store, url, redis_url):
    """QA: `{"min_gain": 0.5, "min_gain": 0.0}` was read as its last value without a word; a body that reads two
    ways is refused (as a plan or load file is)."""
    raw = RawRedis(redis_url, store.cluster)
    before = raw.snapshot()
    r = requests.post(f"{url}/v1/config", data='{"min_gain": 0.5, "min_gain": 0.0}', auth=AUTH)
    assert r.status_code == 400 and "key 'min_gain' appears twice" in r.json()["msg"], r.text
    assert raw.snapshot() == before
