"""Failpoints: named places where a process can be made to hang or stop, for kill and fencing tests.

Set ``FDEPLB_FAILPOINTS`` to a comma-separated list of ``name=STATE`` items, e.g.
``coordinator.hang=LOADING,rank.hang=SWAPPING``. When code reaches ``failpoint(name, state)`` with a matching
state, the action named by the suffix of ``name`` runs:

- ``*.hang``: announce it (``on_hit`` callback, e.g. an event in Redis) and block forever (until killed);
- ``*.stop``: announce it and ``SIGSTOP`` the process itself (a test ``SIGCONT``s it later).

A failpoint armed with a signal's name instead of a state (``engine.hang=SIGUSR1``) is a switch that signal flips
(:func:`switch`): the sim worker's forward-step loop holds while it is on, every other thread running on (a hung
engine whose heartbeat goes on), and goes on when the signal comes again.

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


def switch(name: str) -> threading.Event | None:
    """The switch failpoint ``name`` (see module doc): an Event that the armed signal flips (set = on), its handler
    installed now (call from the main thread); None when ``name`` is not armed with a signal's name. A name that
    is not a signal: :class:`ValueError`."""
    spec = _ACTIVE.get(name)
    if not spec:
        return None
    sig = getattr(signal, spec, None)
    if not isinstance(sig, signal.Signals):
        raise ValueError(f"failpoint {name}={spec}: not a signal's name (e.g. SIGUSR1)")
    on = threading.Event()

    def flip(_signum: int, _frame: object) -> None:
        if on.is_set():
            on.clear()
        else:
            on.set()

    signal.signal(sig, flip)
    return on
