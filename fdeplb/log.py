"""structlog set-up shared by the CLI, the demo and the worker processes."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of the write (tests and tools swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(level: str = "INFO", stream: TextIO | None = None, *, json: bool = False) -> None:
    """Route fdeplb's structlog output to ``stream`` (default stderr) at ``level``; key=value or JSON lines."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(stream or _CurrentStderr()),
        cache_logger_on_first_use=False,
    )
