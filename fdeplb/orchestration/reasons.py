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
from enum import Enum
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

if TYPE_CHECKING:
    from fdeplb.orchestration.gating import GateDecision

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


def gated(decision: "GateDecision") -> str | None:
    """The abort reason of a round the gate skips (:class:`fdeplb.orchestration.gating.GateDecision`), with the
    numbers (4 decimals); None when the round goes on."""
    why = decision.why_skipped
    if why is None:
        return None
    return (f"{GATED}{why} (balancedness {decision.balancedness_before:.4f} -> {decision.balancedness_after:.4f}, "
            f"{decision.moved_experts} moved experts)")


def gate(before: float, after: float, moved: int, min_gain: float) -> str | None:
    """:func:`gated` for bare figures: mean balancedness ``before`` / ``after``, ``moved`` experts, ``min_gain``."""
    from fdeplb.orchestration.gating import GateDecision

    return gated(GateDecision(np.empty((0, 0), dtype=np.int64), before, after, moved, min_gain))


def external_commit(by: str) -> str:
    """The reason of a cordoned cluster's commit, naming who requested it (``""``: an older request, unnamed)."""
    return EXTERNAL + (by or "operator")


class RoundOutcome(str, Enum):
    """How a round ended, as :func:`round_outcome` reads it from the round's last cluster audit record."""

    RUNNING = "running"        # not back to FREE yet
    REARRANGED = "rearranged"  # DONE -> FREE: the plan was committed and swapped everywhere
    SKIPPED = "skipped"        # a gated abort: nothing worth moving (a normal outcome, with its numbers)
    ABORTED = "aborted"        # any other abort: the old placement stayed active


def round_outcome(last: Mapping[str, Any] | None) -> tuple[RoundOutcome, str]:
    """The one rule for a round's outcome: (outcome, reason) from its last cluster audit record (a mapping with
    ``from``, ``to``, ``trigger``, ``reason``; None: nothing recorded, an abort). The reason of a skip is the gate's
    text without its ``gated: skipped:`` prefix."""
    from fdeplb.machines.tables import ClusterState

    if last is None:
        return RoundOutcome.ABORTED, "no cluster transition recorded"
    if last["to"] != ClusterState.FREE:
        return RoundOutcome.RUNNING, ""
    if last["from"] == ClusterState.DONE:
        return RoundOutcome.REARRANGED, ""
    reason = str(last["reason"])
    if reason.startswith(GATED):
        return RoundOutcome.SKIPPED, reason.removeprefix(GATED).strip()
    return RoundOutcome.ABORTED, reason or f"{last['from']} -> {last['to']} ({last['trigger']})"


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
