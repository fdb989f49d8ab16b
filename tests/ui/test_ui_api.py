"""The web view's routes and read model without a browser: authentication, the JSON shapes, bad parameters, the
event stream (also while Redis is down), the annotated diagrams, and the player's steps and replay checks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from fdeplb.api import ApiSettings, create_app
from fdeplb.api.auth import Credentials
from fdeplb.api.routes import create_player_app
from fdeplb.api.ui_routes import _svg_of
from fdeplb.machines.tables import TABLES, ClusterState, RankState
from fdeplb.orchestration.cluster_setup import init_cluster
from fdeplb.placement import initial_placement
from fdeplb.store import ClusterConfig, Store
from fdeplb.ui import PlayerModel, annotated_diagrams
from tests.api_helpers import AUTH, PASSWORD, USER

REPLAYS = Path(__file__).resolve().parents[1] / "replays"


@pytest.fixture
def client(redis_url, cluster_id):
    store = Store(redis_url, cluster_id)
    cfg = ClusterConfig(num_layers=2, num_logical_experts=8, num_physical_experts=10, ep_size=2)
    init_cluster(store, cfg, initial_placement(2, 8, 10).phy2log)
    for r in range(2):
        store.register_rank(r, {"api_address": f"10.1.0.{r}:8000"})
        store.heartbeat(r, heartbeat_ttl_ms=60_000)
    app = create_app(store, Credentials(USER, PASSWORD), ApiSettings())
    with TestClient(app) as c:
        yield c
    store.delete_cluster()


@pytest.mark.parametrize("path", ["/ui", "/ui/app.js", "/ui/style.css", "/v1/ui/view", "/v1/ui/audit",
                                  "/v1/ui/diagrams", "/v1/ui/events"])
def test_every_ui_route_asks_a_browser_for_credentials(client, path):
    r = client.get(path)
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Basic")
    assert client.get(path, auth=(USER, "wrong")).status_code == 401


def test_the_page_and_its_files_are_served_from_the_package_and_nothing_else(client):
    page = client.get("/ui", auth=AUTH)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/ui/app.js">' in page.text and "http://" not in page.text and "https://" not in page.text
    js = client.get("/ui/app.js", auth=AUTH)
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    # nothing fetched from the internet: the only absolute URL is the SVG namespace name (an identifier)
    assert not re.search(r"https?://", js.text.replace('"http://www.w3.org/2000/svg"', ""))
    assert client.get("/ui/style.css", auth=AUTH).headers["content-type"].startswith("text/css")
    for name in ("nope.js", "__init__.py", "..%2Fview_model.py"):
        assert client.get(f"/ui/{name}", auth=AUTH).status_code == 404
    # the browser runs the page's own script only, and requests go to this server only
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "unsafe-eval" not in csp
    assert "'unsafe-inline'" not in csp.split("script-src")[1].split(";")[0]
    assert js.headers["content-security-policy"] == csp and page.headers["x-content-type-options"] == "nosniff"
    assert "innerHTML = rankTip" not in js.text  # the rank tooltip (Redis values) is built from text nodes


def test_view_shape(client):
    r = client.get("/v1/ui/view", auth=AUTH)
    assert r.status_code == 200
    view = r.json()
    assert view["mode"] == "live" and view["redis"] == "ok"
    assert view["summary"]["state"] == ClusterState.FREE.value and view["summary"]["round"] == 0
    assert set(view["current"]) == set(TABLES) == set(view["states"]) == set(view["last"])
    assert view["current"]["cluster"] == {ClusterState.FREE.value: 1}
    assert view["current"]["rank"] == {RankState.IDLE.value: 2}
    assert [r["ep_rank"] for r in view["ranks"]] == [0, 1]
    row = view["ranks"][0]
    assert {"state", "weights", "membership", "stale", "heartbeat_age_ms", "heartbeat_ttl_ms", "step",
            "staged_bytes"} <= set(row)
    assert row["stale"] is False and row["heartbeat_ttl_ms"] == 60_000
    assert view["counts"]["stale"] == 0 and view["timeline"]["rounds"] == [] and view["plan"] is None


def test_audit_filters_are_checked(client):
    ok = client.get("/v1/ui/audit", params={"machine": "cluster", "rank": "1", "round": "3", "limit": "10"},
                    auth=AUTH)
    assert ok.status_code == 200 and ok.json() == {"rows": []}
    for params in ({"machine": "bogus"}, {"rank": "x"}, {"rank": "-1"}, {"round": "1.5"}, {"limit": "99999"},
                   {"rank": "1" * 12}):
        r = client.get("/v1/ui/audit", params=params, auth=AUTH)
        assert r.status_code == 400, params
        assert r.json()["code"] == 1 and "must be" in r.json()["msg"]


def test_event_stream_sends_the_view(client):
    with client.stream("GET", "/v1/ui/events", auth=AUTH) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        line = next(ln for ln in r.iter_lines() if ln.startswith("data: "))
    assert json.loads(line[6:])["summary"]["state"] == ClusterState.FREE.value


def test_redis_unavailable_is_said_by_the_view_and_the_stream():
    from tests.api_helpers import free_port

    store = Store(f"redis://127.0.0.1:{free_port()}/0", "gone")  # nothing listens there
    app = create_app(store, Credentials(USER, PASSWORD), ApiSettings())
    with TestClient(app) as c:
        r = c.get("/v1/ui/view", auth=AUTH)
        assert r.status_code == 503 and r.json()["code"] == 1
        with c.stream("GET", "/v1/ui/events", auth=AUTH) as s:
            line = next(ln for ln in s.iter_lines() if ln.startswith("data: "))
    assert json.loads(line[6:])["redis"] == "unavailable"


def test_diagrams_carry_the_dom_contract_on_every_state_and_edge():
    svgs = annotated_diagrams(_svg_of)
    assert set(svgs) == set(TABLES)
    for name, table in TABLES.items():
        states = re.findall(rf'data-machine="{name}" data-state="(\w+)"', svgs[name])
        assert sorted(states) == sorted(s.value for s in table.states)
        edges = set(re.findall(r'data-from="(\w+)" data-trigger="(\w+)" data-to="(\w+)"', svgs[name]))
        assert edges == {(s.value, t.trigger, t.dest.value) for t in table.transitions for s in t.sources}


# ---- the player --------------------------------------------------------------------------------------------------
def test_player_of_happy_steps_from_the_start_to_free():
    player = PlayerModel(REPLAYS / "happy.jsonl")
    assert player.checks["ok"] and player.checks["failure"] is None
    start = player.view("0")
    assert start["summary"]["state"] == ClusterState.FREE.value and start["player"]["record"] is None
    states = [player.view(str(s))["summary"]["state"] for s in range(len(player.records) + 1)]
    assert states[-1] == ClusterState.FREE.value
    lifecycle = [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]]
    assert lifecycle == [ClusterState.FREE, ClusterState.COLLECTING, ClusterState.PLANNING, ClusterState.LOADING,
                         ClusterState.LOAD_SUCC, ClusterState.SWAPPING, ClusterState.DONE, ClusterState.FREE]
    last = player.view()
    assert last["player"]["step"] == len(player.records) and last["player"]["record"]["check"] == "ok"
    (round_,) = last["timeline"]["rounds"]
    assert round_["outcome"] == "rearranged" and len(round_["ranks"]) == 4
    assert [s["state"] for s in round_["cluster"]] == [str(s) for s in lifecycle[1:-1]]
    assert last["plan"]["moved_experts"] == 44 and len(last["plan"]["before"]) == 3


@pytest.mark.parametrize("path", sorted(REPLAYS.glob("*.jsonl")), ids=lambda p: p.name)
def test_every_recording_plays_and_passes(path):
    player = PlayerModel(path)
    assert player.checks["ok"], player.checks["summary"]
    assert all(row["check"] == "ok" for row in player.audit())


def test_a_forged_record_is_marked_at_its_step_with_the_replay_reason(tmp_path):
    lines = (REPLAYS / "happy.jsonl").read_text().splitlines()
    lines[8] = lines[8].replace('"to":"LOADED"', '"to":"SWAPPED"')  # file line 9 = record 8
    bad = tmp_path / "forged.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    player = PlayerModel(bad)
    assert not player.checks["ok"]
    assert player.checks["failure"]["step"] == 8 and player.checks["failure"]["line"] == 9
    rows = player.audit()
    assert [r["check"] for r in rows[:7]] == ["ok"] * 7
    assert rows[7]["check"] == "failed" and "line 9" in rows[7]["reason"] and "per the table" in rows[7]["reason"]
    assert {r["check"] for r in rows[8:]} == {"unchecked"}
    assert player.view("8")["player"]["failed_steps"] == [8]


def test_player_app_routes_and_bad_steps():
    app = create_player_app(PlayerModel(REPLAYS / "happy.jsonl"))
    with TestClient(app) as c:
        assert c.get("/ui").status_code == 200  # a local file on 127.0.0.1: no credentials
        assert c.get("/v1/ui/view", params={"step": "3"}).json()["player"]["step"] == 3
        for bad in ("x", "-1", "28", "1e3"):
            r = c.get("/v1/ui/view", params={"step": bad})
            assert r.status_code == 400 and "step must be" in r.json()["msg"]
        assert len(c.get("/v1/ui/audit", params={"machine": "cluster"}).json()["rows"]) == 7
        assert c.get("/v1/ui/audit", params={"machine": "nope"}).status_code == 400
        assert c.get("/v1/ui/events").status_code == 404  # nothing changes in a recording


def test_replay_ui_refuses_options_it_does_not_take(capsys):
    from fdeplb.cli import main

    assert main(["replay", "--ui", str(REPLAYS / "happy.jsonl"), "--json"]) == 2
    assert "--ui plays the whole recording" in capsys.readouterr().err
    assert main(["replay", "--ui", str(REPLAYS / "missing.jsonl"), "--port", "0"]) == 2


def _first(events, pred, limit: int = 30):
    """The first of ``events`` that ``pred`` holds for, within ``limit`` events (the stream sends at least one a
    second: a deadline of about ``limit`` seconds)."""
    for _, event in zip(range(limit), events):
        if pred(event):
            return event
    raise AssertionError(f"no such event within {limit} events")


def test_event_stream_says_redis_unavailable_while_it_is_down_and_recovers_after(tmp_path, cluster_id):
    """A real redis-server (appendonly) SIGKILLed under an open stream, then started again on the same port."""
    from tests.servers import RedisServer

    server = RedisServer(tmp_path / "redis")
    try:
        store = Store(server.url, cluster_id)
        cfg = ClusterConfig(num_layers=2, num_logical_experts=8, num_physical_experts=10, ep_size=2)
        init_cluster(store, cfg, initial_placement(2, 8, 10).phy2log)
        app = create_app(store, Credentials(USER, PASSWORD), ApiSettings())
        with TestClient(app) as c, c.stream("GET", "/v1/ui/events", auth=AUTH) as s:
            events = (json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: "))
            assert next(events)["summary"]["state"] == ClusterState.FREE.value
            server.kill()
            assert _first(events, lambda e: "summary" not in e)["redis"] == "unavailable"
            server.start()
            back = _first(events, lambda e: "summary" in e)
        assert back["redis"] == "ok" and back["summary"]["state"] == ClusterState.FREE.value
    finally:
        server.close()


def test_a_gated_round_is_shown_skipped_not_aborted():
    last = PlayerModel(REPLAYS / "gated_skip.jsonl").view()
    outcomes = {r["round"]: r["outcome"] for r in last["timeline"]["rounds"]}
    assert "skipped" in outcomes.values() and "aborted" not in outcomes.values(), outcomes
    kinds = [m["kind"] for r in last["timeline"]["rounds"] for m in r["marks"]]
    assert "skip" in kinds and "abort" not in kinds, kinds


# ---- what an operator must know or do (issue 34 item 10) -----------------------------------------------------------
def test_a_cordoned_round_in_load_succ_says_it_waits_for_a_commit_with_the_command():
    player = PlayerModel(REPLAYS / "cordoned_http.jsonl")
    waits = {}
    for step in range(len(player.records) + 1):
        view = player.view(str(step))
        assert view["summary"]["cordoned"] is True
        if view["waiting"] is not None:
            waits[step] = view["waiting"]
        assert (view["waiting"] is not None) == (view["summary"]["state"] == ClusterState.LOAD_SUCC.value)
    (step, waiting), = waits.items()  # the one LOAD_SUCC step: then the commit over HTTP
    plan = player.plans[waiting["plan_id"]]
    assert waiting["command"] == (f"fdeplb rearrange --redis-url URL --cluster {player.header['cluster']} "
                                  f"--commit {plan.plan_id}")
    assert (waiting["round"], waiting["moved_experts"]) == (1, plan.moved_experts)
    assert waiting["balancedness_after"] == plan.balancedness_after and waiting["deadline_left_ms"] > 0
    assert waiting["title"] == f"Waiting for an operator's commit: round 1, plan {plan.plan_id}"
    assert waiting["text"].startswith(f"The cluster is cordoned: every rank has staged the plan (balancedness "
                                      f"{plan.balancedness_before:.4f} -> {plan.balancedness_after:.4f}, "
                                      f"{plan.moved_experts} experts move)")
    assert f"Not committed within {waiting['deadline_left_ms'] / 1000:.0f} s, the round aborts." in waiting["text"]
    assert PlayerModel(REPLAYS / "happy.jsonl").view("4")["waiting"] is None  # LOAD_SUCC, not cordoned


def test_the_live_view_says_when_the_records_are_gone_and_when_the_cluster_was_made_anew(redis_url, cluster_id):
    store = Store(redis_url, cluster_id)
    cfg = ClusterConfig(num_layers=2, num_logical_experts=8, num_physical_experts=10, ep_size=2, cordoned=True)
    init_cluster(store, cfg, initial_placement(2, 8, 10).phy2log)
    app = create_app(store, Credentials(USER, PASSWORD), ApiSettings())
    try:
        with TestClient(app) as c:
            first = c.get("/v1/ui/view", auth=AUTH).json()
            assert first["gone"] is None and first["recreated"] is None and first["summary"]["cordoned"] is True
            assert first["waiting"] is None  # cordoned, but no round staged
            store.delete_cluster()  # as Redis restarted empty: no configuration, no records
            r = c.get("/v1/ui/view", auth=AUTH)
            assert r.status_code == 200
            gone = r.json()
            assert gone["summary"]["state"] is None and gone["ranks"] == [] and gone["current"]["cluster"] == {}
            assert gone["gone"]["last_seen"]["round"] == 0 and gone["gone"]["last_seen"]["state"] == "FREE"
            assert gone["gone"]["text"].startswith(f"Redis holds no records of cluster {cluster_id}: they were lost")
            assert "last seen in round 0, FREE v0" in gone["gone"]["text"] and "fdeplb init-cluster" in gone["gone"]["text"]
            with c.stream("GET", "/v1/ui/events", auth=AUTH) as s:  # the stream says it too, and goes on
                line = next(ln for ln in s.iter_lines() if ln.startswith("data: "))
            assert json.loads(line[6:])["gone"]["last_seen"]["state"] == "FREE"
            init_cluster(store, cfg, initial_placement(2, 8, 10).phy2log)
            again = c.get("/v1/ui/view", auth=AUTH).json()
            assert again["gone"] is None and again["summary"]["state"] == ClusterState.FREE.value
            assert again["recreated"]["last_seen"]["state"] == "FREE"
            assert again["recreated"]["text"].startswith(f"Cluster {cluster_id} was created anew")
    finally:
        store.delete_cluster()


def test_a_never_initialised_cluster_is_said_so():
    from fdeplb.store.embedded import EmbeddedRedis

    with EmbeddedRedis() as server:
        store = Store(server.url, "never")
        app = create_app(store, Credentials(USER, PASSWORD), ApiSettings())
        with TestClient(app) as c:
            view = c.get("/v1/ui/view", auth=AUTH).json()
    assert view["gone"]["last_seen"] is None and "it was never initialised on this Redis" in view["gone"]["text"]


def test_the_commit_command_names_no_password():
    from fdeplb.ui.view_model import _without_password

    assert _without_password("redis://:s3cret@host:6379/0") == "redis://host:6379/0"
    assert _without_password("redis://user:s3cret@host:6379/0") == "redis://user@host:6379/0"
    assert _without_password("redis://host:6379/0") == "redis://host:6379/0"
    assert _without_password("unix:///run/redis.sock") == "unix:///run/redis.sock"
