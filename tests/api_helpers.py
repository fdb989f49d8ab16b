"""Serving the API on loopback for tests: uvicorn in a thread, or `fdeplb serve` processes."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import requests
import uvicorn

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
