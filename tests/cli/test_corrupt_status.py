"""Corrupt values in Redis degrade ``fdeplb status`` (text, --json, --url), ``GET /v1/state`` and ``/metrics`` per
record: the record that does not parse is shown as CORRUPT with the error naming its key and field, every other
record as usual; status exits 8 while printing everything readable, /v1/state answers 200, fdeplb_up stays 1."""

from __future__ import annotations

import json

import pytest
import requests

from fdeplb.api import Credentials, create_app
from fdeplb.store import Store
from tests.api_helpers import AUTH, PASSWORD, USER, served
from tests.helpers import RawRedis, run_cli

EP = 2  # the ranks of conftest's two_rank_store


@pytest.fixture
def store(two_rank_store):
    return two_rank_store


RANK_STATE = "field 'state' holds 'BOGUS', not a valid RankState (RankRecord)"
WEIGHTS_VERSION = "field 'version' holds 'v7', not a valid int (WeightRecord)"


@pytest.fixture
def url(store, monkeypatch):
    """An API served over ``store`` (credentials in the environment for ``status --url``)."""
    monkeypatch.setenv("FDEPLB_API_USER", USER)
    monkeypatch.setenv("FDEPLB_API_PASSWORD", PASSWORD)
    with served(create_app(store, Credentials(USER, PASSWORD))) as base:
        yield base


def statuses(capsys, redis_url, store, url):
    """(exit code, --json dict, text, stderr) of ``status`` over Redis and over --url, in that order."""
    out = []
    for where in (["--redis-url", redis_url, "--cluster", store.cluster], ["--url", url]):
        code, text, err = run_cli(capsys, "status", *where, "--json")
        got = json.loads(next(ln for ln in text.splitlines() if ln.startswith('{"cluster"')))  # (server logs)
        code2, text, err2 = run_cli(capsys, "status", *where)
        err, err2 = (("".join(ln for ln in e.splitlines(True) if ln.startswith("error:"))) for e in (err, err2))
        assert (code2, err2) == (code, err)
        out.append((code, got, text, err))
    return out


def metrics(url: str) -> str:
    r = requests.get(f"{url}/metrics", auth=AUTH)
    assert r.status_code == 200
    return r.text


def test_corrupt_rank_and_weights_records_are_marked_and_the_rest_is_shown(redis_url, store, url, capsys):
    raw = RawRedis(redis_url, store.cluster)
    rank0, weights1 = raw.keys.rank(0), raw.keys.weights(1)
    saved = {rank0: raw.r.hget(rank0, "state"), weights1: raw.r.hget(weights1, "version")}
    raw.r.hset(rank0, "state", "BOGUS")     # an unknown rank state
    raw.r.hset(weights1, "version", "v7")  # a version that is not an integer
    expected = [{"key": rank0, "error": f"{rank0}: {RANK_STATE}"},
                {"key": weights1, "error": f"{weights1}: {WEIGHTS_VERSION}"}]
    for code, got, text, err in statuses(capsys, redis_url, store, url):
        assert code == 8 and got["corrupt"] == expected
        assert err == f"error: 2 stored values of cluster {store.cluster} did not parse: {rank0}, {weights1}\n"
        assert got["rearrange"]["state"] == "FREE" and got["placement"]["corrupt"] is False
        assert got["placement"]["plan_id"] == ""
        r0, r1 = got["ranks"]
        assert (r0["state"], r0["version"], r0["load_result"], r0["routing"], r0["weights"], r0["weights_version"]) \
            == ("CORRUPT", None, None, None, "NORMAL", 0)
        assert (r1["state"], r1["version"], r1["routing"], r1["weights"], r1["weights_code"], r1["weights_version"]) \
            == ("IDLE", 0, "not_reported", "CORRUPT", None, None)
        assert f"  CORRUPT    {rank0}: {RANK_STATE}\n" in text
        assert f"  CORRUPT    {weights1}: {WEIGHTS_VERSION}\n" in text
        assert "  rearrange  FREE [0]  v0  round 0" in text and "  placement  initial  v0" in text
        rows = {ln.split()[0]: ln.split() for ln in text.splitlines() if ln[:3] in ("  0", "  1")}  # (server logs)
        assert len(rows) == EP
        assert rows["0"][1:5] == ["CORRUPT", "-", "NORMAL", "0"]
        assert rows["1"][1:5] == ["IDLE", "0", "CORRUPT", "-"]
    r = requests.get(f"{url}/v1/state", auth=AUTH)
    assert r.status_code == 200 and r.json()["corrupt"] == expected
    text = metrics(url)
    assert "fdeplb_up 1.0" in text and "fdeplb_corrupt_records 2.0" in text
    assert "fdeplb_cluster_state_code 0.0" in text and "fdeplb_round 0.0" in text
    assert 'fdeplb_staging_bytes{ep_rank="1"}' in text
    assert 'fdeplb_staging_bytes{ep_rank="0"}' not in text  # the corrupt rank record's series is skipped

    for key, value in saved.items():  # restored: the marks go away
        raw.r.hset(key, "state" if key == rank0 else "version", value)
    for code, got, text, err in statuses(capsys, redis_url, store, url):
        assert (code, err, got["corrupt"]) == (0, "", [])
        assert [(r["state"], r["weights"]) for r in got["ranks"]] == [("IDLE", "NORMAL")] * EP
        assert "CORRUPT" not in text
    assert requests.get(f"{url}/v1/state", auth=AUTH).json()["corrupt"] == []
    text = metrics(url)
    assert "fdeplb_corrupt_records 0.0" in text and 'fdeplb_staging_bytes{ep_rank="0"}' in text


def test_corrupt_cluster_record_placement_and_registry_are_marked(redis_url, store, url, capsys):
    raw = RawRedis(redis_url, store.cluster)
    store.register_rank(0, {"api_address": "10.0.0.1:8000"})
    raw.r.hset(raw.keys.rearrange, "version", "x1")
    raw.r.hset(raw.keys.placement, "version", "nope")
    raw.r.hset(raw.keys.ranks, "1", "{not json")
    keys = [raw.keys.rearrange, raw.keys.placement, raw.keys.ranks]
    for code, got, text, err in statuses(capsys, redis_url, store, url):
        assert code == 8 and [c["key"] for c in got["corrupt"]] == keys
        assert got["corrupt"][0]["error"] == (f"{raw.keys.rearrange}: field 'version' holds 'x1', not a valid int "
                                              f"(ClusterRecord)")
        assert got["corrupt"][1]["error"] == f"{raw.keys.placement}: version is not an integer"
        assert got["rearrange"]["state"] == "CORRUPT" and got["rearrange"]["round"] is None
        assert got["placement"] == {"plan_id": None, "version": None, "routing_digest": None, "corrupt": True}
        assert [(r["state"], r["weights"], r["registered"]) for r in got["ranks"]] == [
            ("IDLE", "NORMAL", None)] * EP
        assert "  rearrange  CORRUPT (the cluster record does not parse)\n" in text
        assert "  placement  CORRUPT\n" in text and "not registered" not in text
        assert all(f"  CORRUPT    {c['error']}\n" in text for c in got["corrupt"])
    r = requests.get(f"{url}/v1/state", auth=AUTH)
    assert r.status_code == 200 and r.json()["api_addresses"] == {} and len(r.json()["corrupt"]) == 3
    text = metrics(url)  # the registry is not read by the metrics: 2
    assert "fdeplb_up 1.0" in text and "fdeplb_corrupt_records 2.0" in text
    assert "fdeplb_cluster_state_code" not in text and "fdeplb_round 0.0" not in text
    assert 'fdeplb_staging_bytes{ep_rank="0"}' in text


def test_a_corrupt_configuration_is_still_a_typed_error_with_exit_8(redis_url, store, capsys):
    raw = RawRedis(redis_url, store.cluster)
    raw.r.hset(raw.keys.config, "ep_size", "not json")
    message = f"{raw.keys.config}: field 'ep_size' holds 'not json', which is not JSON"
    for args in ([], ["--json"]):
        code, out, err = run_cli(capsys, "status", "--redis-url", redis_url, "--cluster", store.cluster, *args)
        assert (code, out, err) == (8, "", f"error: {message}\n")
    with served(create_app(Store(redis_url, store.cluster), Credentials(USER, PASSWORD))) as url:
        r = requests.get(f"{url}/v1/state", auth=AUTH)
        assert r.status_code == 500 and r.json() == {"code": 1, "msg": message}
        text = metrics(url)  # Redis answered: up; the configuration is the one corrupt value; no state gauges
        assert "fdeplb_up 1.0" in text and "fdeplb_corrupt_records 1.0" in text
        assert "fdeplb_round " not in text


@pytest.mark.parametrize("entry", ['"10.0.0.2:8000"', "[1]", "null", "7"])
def test_a_registry_entry_that_is_json_but_not_an_object_is_named(redis_url, store, url, capsys, entry):
    """Valid JSON that is not an object used to pass the registry's parse and fail later with a generic
    ``internal error (AttributeError)`` 500 on /v1/state and POST /rearrange_experts (found by the QA pass)."""
    from tests.api_helpers import CREDS

    raw = RawRedis(redis_url, store.cluster)
    raw.r.hset(raw.keys.ranks, "1", entry)
    before = raw.snapshot()
    r = requests.get(f"{url}/v1/state", auth=AUTH)
    assert r.status_code == 200 and r.json()["api_addresses"] == {}
    assert [c["key"] for c in r.json()["corrupt"]] == [raw.keys.ranks]
    r = requests.post(f"{url}/rearrange_experts", json={**CREDS, "ips": ["10.0.0.2:8000"]})
    assert r.status_code == 500 and r.json() == {"code": 1, "msg": f"{raw.keys.ranks}: entry '1' is not a rank's JSON"}
    assert raw.snapshot() == before


@pytest.mark.parametrize("which,method,path", [
    ("rearrange", "POST", "/check_redundant"), ("placement", "GET", "/v1/placement"),
    ("ranks", "POST", "/rearrange_experts"), ("load:0", "POST", "/get_per_expert_tokens_stats"),
    ("audit", "GET", "/v1/audit"), ("audit", "GET", "/clear_load_weight"), ("events", "GET", "/update_model_weight"),
    ("snapshot:1", "POST", "/check_redundant"),
])
def test_a_key_of_the_wrong_redis_type_is_named(redis_url, store, url, which, method, path):
    """A string where fdeplb keeps a hash (or stream) used to answer with Redis's bare 'WRONGTYPE Operation
    against a key holding the wrong kind of value', naming no key (found by the QA pass)."""
    from tests.api_helpers import CREDS

    raw = RawRedis(redis_url, store.cluster)
    store.register_rank(0, {"api_address": "10.0.0.1:8000"})
    key = f"{raw.keys.prefix}:{which}"
    if which == "snapshot:1":  # read for the workloads of a cluster past round 1
        raw.r.hset(raw.keys.rearrange, "round", "1")
    if which == "events":  # a rank to update: the route waits on the streams
        raw.r.hset(raw.keys.weights(0), "state", "CLEARED")
    raw.r.delete(key)
    raw.r.set(key, "planted")
    before = raw.snapshot()
    body = {**CREDS, "ips": ["10.0.0.1:8000"]} if which == "ranks" else \
        {**CREDS, "check_get_workloads": True} if which == "snapshot:1" else CREDS
    r = requests.post(url + path, json=body) if method == "POST" else requests.get(url + path, auth=AUTH)
    assert r.status_code == 500 and r.json()["msg"].startswith(f"{key}: "), r.text
    assert "refused a command" not in r.text
    r = requests.get(f"{url}/v1/state", auth=AUTH)
    if which in ("rearrange", "placement", "ranks"):  # shown per record, the rest as usual
        assert r.status_code == 200 and key in [c["key"] for c in r.json()["corrupt"]], r.text
    assert raw.snapshot() == before
