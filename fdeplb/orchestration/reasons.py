"""The audited reasons whose contents a replay checks: the coordinator writes them, :mod:`fdeplb.replay` reads
them back. One place for each text's format, so the two cannot drift apart.

- a start refused for stale ranks (trigger ``start_refused``, a note) and the start that follows it (its reason
  shows every registered rank's heartbeat fresh again);
- a gated round (trigger ``abort``, reason ``gated: skipped: ...`` with the planned numbers);
- the commit of a cordoned cluster (trigger ``commit``, naming who requested it).

Pure text functions, no I/O. Ages and TTLs are milliseconds (Redis server clock).
"""

from __future__ import annotations

import re
from typing import Mapping

#: reason of a ``start_refused`` note: ``start refused: stale ranks 2 (heartbeat 2412 ms ago), 3 (...)``
REFUSED = "start refused: stale ranks "
#: reason of the start after a refusal: ``start after a refusal: heartbeats 0 12 ms ago (ttl 2000 ms), 1 ...``
FRESH = "start after a refusal: heartbeats "
#: reason of a gated round's abort
GATED = "gated: skipped: "
#: reason of a cordoned cluster's commit: ``external commit requested by http``
EXTERNAL = "external commit requested by "

_STALE_ITEM = re.compile(r"(\d+) \(heartbeat (-?\d+) ms ago\)")
_FRESH_ITEM = re.compile(r"(\d+) (-?\d+) ms ago \((?:ttl (\d+) ms|no ttl)\)")


def refusal(stale: Mapping[int, int]) -> str:
    """The ``start_refused`` reason for ``stale`` (ep_rank -> ms since its heartbeat), ranks in order."""
    return REFUSED + ", ".join(f"{r} (heartbeat {age} ms ago)" for r, age in sorted(stale.items()))


def parse_refusal(reason: str) -> dict[int, int] | None:
    """Inverse of :func:`refusal`: ep_rank -> ms since its heartbeat; None if ``reason`` is not one."""
    return _items(reason, REFUSED, _STALE_ITEM, lambda m: int(m[2]))


def fresh(heartbeats: Mapping[int, tuple[int, int]]) -> str:
    """The reason of a start that follows a refusal: every registered rank's (ms since its heartbeat, TTL ms;
    TTL 0 = none) as :meth:`fdeplb.store.Store.heartbeats` read them, ranks in order."""
    return FRESH + ", ".join(f"{r} {age} ms ago ({f'ttl {ttl} ms' if ttl > 0 else 'no ttl'})"
                             for r, (age, ttl) in sorted(heartbeats.items()))


def parse_fresh(reason: str) -> dict[int, tuple[int, int]] | None:
    """Inverse of :func:`fresh`: ep_rank -> (ms since its heartbeat, TTL ms); None if ``reason`` is not one."""
    return _items(reason, FRESH, _FRESH_ITEM, lambda m: (int(m[2]), int(m[3] or 0)))


def gate(before: float, after: float, moved: int, min_gain: float) -> str | None:
    """The gate on a planned round: None when it goes on (it moves an expert and gains more than ``min_gain`` in
    mean balancedness ``after - before``), else the abort reason of the skip, with the numbers (4 decimals)."""
    if moved != 0 and after - before > min_gain:
        return None
    why = (f"planned gain {after - before:.4f} <= min_gain {min_gain}" if after - before <= min_gain
           else "the plan moves no expert")
    return f"{GATED}{why} (balancedness {before:.4f} -> {after:.4f}, {moved} moved experts)"


def external_commit(by: str) -> str:
    """The reason of a cordoned cluster's commit, naming who requested it (``""``: an older request, unnamed)."""
    return EXTERNAL + (by or "operator")


def _items(reason: str, prefix: str, item: re.Pattern, value):
    if not reason.startswith(prefix):
        return None
    out = {}
    for part in reason[len(prefix):].split(", "):
        m = item.fullmatch(part)
        if m is None:
            return None
        out[int(m[1])] = value(m)
    return out or None
