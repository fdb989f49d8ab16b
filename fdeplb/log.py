"""structlog set-up shared by the CLI, the demo, the API server and the worker processes.

Output is JSON lines when the stream is not a terminal and console rendering when it is (``json=None``, the
default). Context bound with :func:`structlog.contextvars.bind_contextvars` (cluster, round, plan_id, ep_rank) is
merged into every event. Secrets registered with :func:`register_secret` (the API credentials) are replaced by
``"[redacted]"`` wherever they appear in an event, at every level, before anything is rendered.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, TextIO

import structlog

#: event keys whose values are never logged, whatever they hold
SECRET_KEYS = frozenset({"passwd", "password", "authorization", "credentials", "secret"})
REDACTED = "[redacted]"

_secrets: set[str] = set()
_secrets_lock = threading.Lock()


def register_secret(value: str | None) -> None:
    """Never log ``value``: :func:`redact_secrets` replaces it in every event from now on (empty values ignored)."""
    if value:
        with _secrets_lock:
            _secrets.add(str(value))


def _scrub(value: Any, secrets: tuple[str, ...]) -> Any:
    if isinstance(value, str):
        for s in secrets:
            if s in value:
                value = value.replace(s, REDACTED)
        return value
    if isinstance(value, dict):
        return {k: (REDACTED if str(k).lower() in SECRET_KEYS else _scrub(v, secrets)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_scrub(v, secrets) for v in value)
    return value


def redact_secrets(_logger: Any, _method: str, event_dict: dict) -> dict:
    """structlog processor: drop the values of :data:`SECRET_KEYS` and replace every registered secret."""
    with _secrets_lock:
        secrets = tuple(sorted(_secrets, key=len, reverse=True))
    out = {}
    for key, value in event_dict.items():
        if str(key).lower() in SECRET_KEYS:
            out[key] = REDACTED
        else:
            out[key] = _scrub(value if isinstance(value, (str, dict, list, tuple)) else
                              (value if isinstance(value, (int, float, bool, type(None))) else str(value)),
                              secrets)
    return out


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of the write (tests and tools swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return bool(getattr(sys.stderr, "isatty", lambda: False)())


def configure(level: str = "INFO", stream: TextIO | None = None, *, json: bool | None = None) -> None:
    """Route fdeplb's structlog output to ``stream`` (default stderr) at ``level``.

    ``json``: True for JSON lines, False for console rendering, None (default) for JSON unless the stream is a
    terminal."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    out = stream or _CurrentStderr()
    if json is None:
        json = not bool(getattr(out, "isatty", lambda: False)())
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            redact_secrets,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
