"""Serving the API on loopback for tests: uvicorn in a thread (:func:`app_of` a thread cluster's app), or `fdeplb
serve` processes (:func:`serve_process`) over a cluster of registered ranks (:func:`registered_cluster`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import requests
import uvicorn

from fdeplb.api import ApiSettings, Credentials, create_app
from fdeplb.orchestration.cluster_setup import init_cluster
from fdeplb.placement import initial_placement
from fdeplb.store import ClusterConfig, Store

ROOT = Path(__file__).resolve().parents[1]

USER, PASSWORD = "operator", "s3cret-pa55-Zq9"
AUTH = (USER, PASSWORD)
CREDS = {"user": USER, "passwd": PASSWORD}


@contextmanager
def served(app):
    """Serve ``app`` on 127.0.0.1 (a free port) in a thread; yields the base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, access_log=False,
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > end or not thread.is_alive():
            raise AssertionError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float = 60.0, proc=None) -> None:
    """Wait until something answers HTTP at ``url`` (any status)."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            requests.get(url + "/health", timeout=2)
            return
        except requests.RequestException:
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"server exited with {proc.returncode}")
            if time.monotonic() > end:
                raise AssertionError(f"nothing answers at {url}")
            time.sleep(0.05)


def app_of(tc, **settings):
    """The API app over thread cluster ``tc``'s store, with the test credentials and ``settings``."""
    return create_app(tc.store(), Credentials(USER, PASSWORD), ApiSettings(**settings))


def registered_cluster(redis_url, cluster_id, ep_size=2):
    """A cluster of ``ep_size`` registered, heartbeating ranks (2 layers, 8 experts in 10 slots): (store, their
    API addresses)."""
    store = Store(redis_url, cluster_id)
    cfg = ClusterConfig(num_layers=2, num_logical_experts=8, num_physical_experts=10, ep_size=ep_size)
    init_cluster(store, cfg, initial_placement(2, 8, 10).phy2log)
    for r in range(ep_size):
        store.register_rank(r, {"api_address": f"10.1.0.{r}:8000"})
        store.heartbeat(r)
    return store, [f"10.1.0.{r}:8000" for r in range(ep_size)]


def serve_process(redis_url, cluster_id, port, *extra, env_creds=True):
    """An `fdeplb serve` process on ``port`` (credentials from the environment unless ``env_creds`` is False)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("FDEPLB_API_USER", None)
    env.pop("FDEPLB_API_PASSWORD", None)
    if env_creds:
        env.update(FDEPLB_API_USER=USER, FDEPLB_API_PASSWORD=PASSWORD)
    return subprocess.Popen([sys.executable, "-m", "fdeplb", "serve", "--redis-url", redis_url, "--cluster",
                             cluster_id, "--port", str(port), "--log-level", "DEBUG", *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
