"""`fdeplb serve` as an operator runs it: TLS with a self-signed certificate made at test time, the HTTP
clients verifying it (``--ca-cert`` / ``REQUESTS_CA_BUNDLE``) on an install without the server's extra; SIGTERM
with an audit long-poll open ends the poll and the process long before the poll's own end; "serving" is logged
only once the port is bound."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis
import requests

from tests.api_helpers import AUTH, PASSWORD, USER, free_port, registered_cluster, serve_process, wait_http
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

#: run the CLI with the api extra's modules made unimportable: what README's first install (`.[paddle]`) has
NO_API_EXTRA = ("import sys\nfor m in ('fastapi', 'uvicorn', 'starlette', 'prometheus_client'): sys.modules[m] = None\n"
                "from fdeplb.cli import main\nsys.exit(main(sys.argv[1:]))")


def _self_signed(tmp_path: Path) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return str(cert), str(key)


def _client(*args, env=None):
    full = {**os.environ, "PYTHONPATH": str(ROOT), "FDEPLB_API_USER": USER, "FDEPLB_API_PASSWORD": PASSWORD,
            **(env or {})}
    return subprocess.run([sys.executable, "-c", NO_API_EXTRA, *args], env=full, capture_output=True, text=True,
                          timeout=120)


def test_status_over_tls_with_credentials_without_the_api_extra(redis_url, cluster_id, tmp_path):
    store, _ = registered_cluster(redis_url, cluster_id)
    cert, key = _self_signed(tmp_path)
    port = free_port()
    proc = serve_process(redis_url, cluster_id, port, "--ssl-certfile", cert, "--ssl-keyfile", key)
    url = f"https://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(url, cert) or proc.poll() is not None, 60, None, "serve over TLS")
        assert proc.poll() is None
        done = _client("status", "--url", url, "--ca-cert", cert)
        assert done.returncode == 0 and "rearrange  FREE" in done.stdout, done.stdout + done.stderr
        done = _client("status", "--url", url, "--json", env={"REQUESTS_CA_BUNDLE": cert})
        assert done.returncode == 0 and '"state"' in done.stdout, done.stderr
        done = _client("status", "--url", url, env={"REQUESTS_CA_BUNDLE": ""})  # the system's CAs: not ours
        assert done.returncode == 7 and "certificate was not verified" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(f"http://127.0.0.1:{port}/health", timeout=5)  # no plain HTTP on the TLS port
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
        store.delete_cluster()


def _answers(url, cert) -> bool:
    try:
        return requests.get(url + "/health", verify=cert, timeout=2).status_code in (200, 503)
    except requests.RequestException:
        return False


def test_serve_refuses_half_a_tls_setting(redis_url, cluster_id, tmp_path):
    cert, _ = _self_signed(tmp_path)
    proc = serve_process(redis_url, cluster_id, free_port(), "--ssl-certfile", cert)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--ssl-certfile and --ssl-keyfile go together" in err


def test_sigterm_with_an_open_long_poll_ends_it_and_exits_before_the_poll_would(redis_url, cluster_id):
    store, _ = registered_cluster(redis_url, cluster_id)
    port = free_port()
    proc = serve_process(redis_url, cluster_id, port)
    url = f"http://127.0.0.1:{port}"
    raw = redis.Redis.from_url(redis_url)
    answer: dict = {}
    try:
        wait_http(url, proc=proc)
        last = f"{store.now_ms()}-0"  # nothing after it yet: the poll waits
        poll = threading.Thread(target=lambda: answer.update(r=requests.get(
            f"{url}/v1/audit", params={"since": last, "wait_ms": 30_000}, auth=AUTH, timeout=60)))
        poll.start()
        # the long poll is open: a client of the server blocked in XREAD
        wait_for(lambda: any(c.get("cmd") in ("xread", "xread|block") for c in raw.client_list()), 30, None,
                 "the long poll blocked in Redis")
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=10)  # the poll asked for 30 s: before the fix the process lived that long
        poll.join(10)
        assert not poll.is_alive() and answer["r"].status_code == 200 and answer["r"].json()["records"] == []
        assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it stopped on
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        store.delete_cluster()


def test_serving_is_logged_only_once_bound(redis_url, cluster_id):
    store, _ = registered_cluster(redis_url, cluster_id)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = serve_process(redis_url, cluster_id, port)
        out, err = proc.communicate(timeout=60)
    try:
        assert proc.returncode != 0
        assert '"serving"' not in out + err and "serving " not in out + err, out + err
        assert f"could not serve on 127.0.0.1:{port}" in err
    finally:
        store.delete_cluster()
