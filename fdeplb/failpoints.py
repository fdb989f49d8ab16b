"""Failpoints: named places where a process can be made to hang or stop, for kill and fencing tests.

Set ``FDEPLB_FAILPOINTS`` to a comma-separated list of ``name=STATE`` items, e.g.
``coordinator.hang=LOADING,rank.hang=SWAPPING``. When code reaches ``failpoint(name, state)`` with a matching
state, the action named by the suffix of ``name`` runs:

- ``*.hang``: announce it (``on_hit`` callback, e.g. an event in Redis) and block forever (until killed);
- ``*.stop``: announce it and ``SIGSTOP`` the process itself (a test ``SIGCONT``s it later).

Unset (production), every call is a dictionary lookup that finds nothing.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable


def _parse(spec: str) -> dict[str, str]:
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, state = item.partition("=")
        out[name.strip()] = state.strip()
    return out


_ACTIVE = _parse(os.environ.get("FDEPLB_FAILPOINTS", ""))


def failpoint(name: str, state: str, on_hit: Callable[[], None] | None = None) -> None:
    """Run the failpoint ``name`` if it is armed for ``state`` (see module doc); otherwise return at once."""
    if not _ACTIVE or _ACTIVE.get(name) != state:
        return
    if on_hit is not None:
        on_hit()
    if name.endswith(".stop"):
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    threading.Event().wait()  # hang until the process is killed
