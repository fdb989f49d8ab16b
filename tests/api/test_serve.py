"""`fdeplb serve` processes: concurrent starts through several servers, credentials never logged, the HTTP CLI
clients, and a schemathesis run over the OpenAPI schema."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from fdeplb.cli import main
from fdeplb.machines.tables import WEIGHTS
from fdeplb.orchestration.handles import RecordHandle
from fdeplb.store import Store
from tests.api_helpers import AUTH, CREDS, PASSWORD, USER, free_port, registered_cluster, serve_process, wait_http
from tests.helpers import RawRedis

ROOT = Path(__file__).resolve().parents[2]


def _stop(procs):
    out = []
    for p in procs:
        p.terminate()
    for p in procs:
        o, e = p.communicate(timeout=30)
        out.append(o + e)
    return out


@pytest.mark.slow
def test_100_concurrent_starts_through_3_servers_start_one_round_and_never_log_the_password(redis_url, cluster_id):
    store, ips = registered_cluster(redis_url, cluster_id)
    ports = [free_port() for _ in range(3)]
    procs = [serve_process(redis_url, cluster_id, port) for port in ports]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for url, proc in zip(urls, procs):
            wait_http(url, proc=proc)
        # every log level sees authenticated and refused traffic
        requests.post(f"{urls[0]}/check_redundant", json={"user": USER, "passwd": PASSWORD + "-wrong"})
        requests.get(f"{urls[1]}/v1/state", auth=(USER, PASSWORD))

        def start(i):
            r = requests.post(f"{urls[i % 3]}/rearrange_experts", json={**CREDS, "ips": ips}, timeout=60)
            return r.status_code, r.json()

        with ThreadPoolExecutor(32) as pool:
            replies = list(pool.map(start, range(100)))
    finally:
        logs = _stop(procs)
    accepted = [b for code, b in replies if code == 200]
    refused = [b for code, b in replies if code != 200]
    assert len(accepted) == 1 and accepted[0]["round"] == 1
    assert len(refused) == 99
    assert all(b["code"] == 1 and b["msg"].startswith("rearrange is doing") for b in refused), refused[:3]
    assert store.read_cluster().requested == 1
    text = "\n".join(logs)
    assert '"event": "request body"' in text and '"level": "debug"' in text and '"passwd": "[redacted]"' in text
    assert PASSWORD not in text and "s3cret" not in text


def test_serve_refuses_to_start_without_credentials(redis_url, cluster_id, capsys, monkeypatch, tmp_path):
    registered_cluster(redis_url, cluster_id)
    monkeypatch.delenv("FDEPLB_API_USER", raising=False)
    monkeypatch.delenv("FDEPLB_API_PASSWORD", raising=False)
    assert main(["serve", "--redis-url", redis_url, "--cluster", cluster_id]) == 2
    assert "no API credentials" in capsys.readouterr().err
    monkeypatch.setenv("FDEPLB_API_USER", USER)
    assert main(["serve", "--redis-url", redis_url, "--cluster", cluster_id]) == 2  # password missing
    bad = tmp_path / "creds"
    bad.write_text("no-separator\n")
    assert main(["serve", "--redis-url", redis_url, "--cluster", cluster_id, "--credentials-file", str(bad)]) == 2


@pytest.mark.slow
def test_insecure_no_auth_warns_on_start(redis_url, cluster_id):
    registered_cluster(redis_url, cluster_id)
    port = free_port()
    proc = serve_process(redis_url, cluster_id, port, "--insecure-no-auth", env_creds=False)
    try:
        wait_http(f"http://127.0.0.1:{port}", proc=proc)
        assert requests.get(f"http://127.0.0.1:{port}/v1/state").status_code == 200
    finally:
        (log,) = _stop([proc])
    assert "WARNING: --insecure-no-auth" in log


@pytest.mark.slow
def test_http_cli_clients_print_what_the_redis_commands_print(redis_url, cluster_id, capsys, monkeypatch, tmp_path):
    store, ips = registered_cluster(redis_url, cluster_id)
    creds = tmp_path / "creds"
    creds.write_text(f"{USER}:{PASSWORD}\n")
    creds.chmod(0o600)
    port = free_port()
    proc = serve_process(redis_url, cluster_id, port, "--credentials-file", str(creds), env_creds=False)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url, proc=proc)
        assert main(["trigger", "--url", url, "--credentials-file", str(creds)]) == 0
        assert "round 1 requested" in capsys.readouterr().out
        assert main(["trigger", "--url", url, "--credentials-file", str(creds)]) == 2
        assert "rearrange is doing" in capsys.readouterr().err
        for view in (["status"], ["status", "--json"], ["audit"], ["audit", "--json"]):
            assert main([*view, "--redis-url", redis_url, "--cluster", cluster_id]) == 0
            direct = capsys.readouterr().out
            assert main([*view, "--url", url, "--credentials-file", str(creds)]) == 0
            over_http = capsys.readouterr().out
            if view[0] == "status":  # times move between the two reads
                strip = lambda s: [ln for ln in s.splitlines() if "heartbeat" not in ln and "now_ms" not in ln
                                   and " ago" not in ln]
                assert len(direct.splitlines()) == len(over_http.splitlines())
                if "--json" not in view:
                    assert strip(direct) == strip(over_http)
            else:
                assert direct == over_http
        # --limit N prints the first N records (of those the filters select), over HTTP as over Redis
        for r in (0, 1):  # 4 audit records per rank: a weight clear, then an update
            handle = RecordHandle(store, WEIGHTS, r, actor="test")
            for trigger in ("clear", "cleared", "update", "updated"):
                handle.fire(trigger)
        full = _audit_lines(capsys, "--redis-url", redis_url, "--cluster", cluster_id)
        assert len(full) == 8, full
        full_of = lambda view: [ln for ln in full if ("weights:1" in ln if "--rank" in view else True)]
        for view in (["--limit", "1"], ["--limit", "5"], ["--limit", "100"], ["--machine", "weights", "--limit", "3"],
                     ["--rank", "1", "--limit", "2"]):
            direct = _audit_lines(capsys, "--redis-url", redis_url, "--cluster", cluster_id, *view)
            over_http = _audit_lines(capsys, "--url", url, "--credentials-file", str(creds), *view)
            assert over_http == direct == full_of(view)[:int(view[-1])], (view, direct, over_http)
        # with --follow it ends once N are printed, not waiting for new ones
        assert _audit_lines(capsys, "--url", url, "--credentials-file", str(creds), "--follow", "--limit", "3") \
            == full[:3]
        for bad in ("0", "-3"):  # refused before any request, as over Redis
            assert main(["audit", "--url", "http://127.0.0.1:1", "--limit", bad]) == 2
            assert f"--limit must be >= 1, got {bad}" in capsys.readouterr().err
        assert main(["status", "--url", url]) == 2  # no credentials
        assert main(["audit", "--url", url, "--redis-url", redis_url, "--cluster", cluster_id]) == 2
    finally:
        _stop([proc])


def _audit_lines(capsys, *args: str) -> list[str]:
    assert main(["audit", *args]) == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.slow
def test_openapi_fuzz_finds_no_5xx_and_refused_calls_change_nothing(redis_url, cluster_id):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from fdeplb.api import ApiSettings, Credentials, create_app
    from tests.api_helpers import served

    registered_cluster(redis_url, cluster_id)
    raw = RawRedis(redis_url, cluster_id)
    app = create_app(Store(redis_url, cluster_id), Credentials(USER, PASSWORD),
                     ApiSettings(weights_timeout_s=0.2))
    schema = schemathesis.openapi.from_dict(app.openapi())
    problems, statuses = [], []
    timeouts = {"/update_model_weight", "/clear_load_weight"}  # a wait that times out is FastDeploy's 404

    with served(app) as url:
        for result in schema.get_all_operations():
            operation = result.ok()

            @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            @given(case=operation.as_strategy(), authed=st.booleans())
            def fuzz(case, authed):
                if authed and isinstance(case.body, dict):
                    case.body.update(CREDS)
                headers = {"Authorization": _basic()} if authed else None
                before = raw.snapshot()
                response = case.call(base_url=url, headers=headers)
                statuses.append(response.status_code)
                if response.status_code >= 500:
                    problems.append((case.method, case.path, case.body, response.status_code, response.text[:200]))
                elif response.status_code >= 400 and case.path not in timeouts and raw.snapshot() != before:
                    problems.append((case.method, case.path, case.body, response.status_code, "state changed"))

            fuzz()
    assert not problems, problems[:5]
    assert len(statuses) > 100 and 200 in statuses and 401 in statuses and 400 in statuses, sorted(set(statuses))


def _basic() -> str:
    import base64

    return "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()


@pytest.mark.parametrize("public", [False, True])
def test_serve_health_is_open_and_metrics_public_opens_only_metrics(redis_url, cluster_id, public):
    """What a probe and Prometheus see of `fdeplb serve` without credentials: /health 200 with no cluster
    data; /metrics 401 unless --metrics-public; every other GET route 401."""
    registered_cluster(redis_url, cluster_id)
    port = free_port()
    proc = serve_process(redis_url, cluster_id, port, *(["--metrics-public"] if public else []))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url, proc=proc)
        r = requests.get(f"{url}/health")
        assert r.status_code == 200 and r.json() == {"code": 0, "msg": "ok"}, r.text
        r = requests.get(f"{url}/metrics")
        assert r.status_code == (200 if public else 401), r.text
        if public:
            assert "fdeplb_up 1.0" in r.text
        assert requests.get(f"{url}/metrics", auth=AUTH).status_code == 200
        assert requests.get(f"{url}/v1/state").status_code == 401
    finally:
        _stop([proc])


@pytest.mark.parametrize("line", ["opé:x", "op:wörd", "op:tab\there"])
def test_credentials_the_server_could_never_match_are_refused_at_start(tmp_path, line):
    from fdeplb.credentials import load_credentials
    from fdeplb.errors import InputError

    path = tmp_path / "creds"
    path.write_text(line + "\n", encoding="utf-8")
    with pytest.raises(InputError, match="printable ASCII"):
        load_credentials(path)
