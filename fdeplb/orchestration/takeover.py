"""Whether a new rank agent may take a rank over from a registered agent whose heartbeat is still fresh: only when
that agent's process is provably dead, i.e. it ran on this same host (hostname, kernel boot id and pid namespace)
and its pid is gone or now names another process (a different start time). That is a worker SIGKILLed and
restarted at once by its supervisor (systemd, a container runtime sharing the pid namespace): it needs no
``--replace``. On another host, or where the process cannot be checked, the rank is refused until the heartbeat
lapses, as before.

The facts come from Linux's ``/proc`` (psutil is not a dependency): ``/proc/sys/kernel/random/boot_id``, the
``/proc/self/ns/pid`` link and field 22 (``starttime``, clock ticks after boot) of ``/proc/<pid>/stat``
(proc(5)). Elsewhere :func:`host_identity` is empty and no takeover happens. The agent's start-up check is
:func:`check_not_driven`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Mapping

import structlog

from fdeplb.errors import StateError
from fdeplb.machines.tables import RANK
from fdeplb.rounds import reasons
from fdeplb.store.liveness import stale_of

__all__ = ["TAKEOVER", "DeadOwner", "audit_if_dead", "check_not_driven", "dead_owner", "host_identity",
           "process_start", "takeover_reason"]

log = structlog.get_logger("fdeplb.agent")

#: the audited trigger of a takeover (a note on the rank record)
TAKEOVER = "takeover_dead_pid"

_PROC = "/proc"


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except (OSError, ValueError):
        return ""


def process_start(pid: int, proc: str = _PROC) -> int | None:
    """Start time of process ``pid`` (int, clock ticks after boot: field 22 of ``/proc/<pid>/stat``); None when no
    such process exists (or ``/proc`` cannot tell)."""
    text = _read(f"{proc}/{int(pid)}/stat")
    # the command name (field 2) is in parentheses and may hold spaces or ')': the fields after it follow the last ')'
    rest = text.rpartition(")")[2].split()
    try:
        return int(rest[19])  # rest[0] is field 3 (state): field 22 is rest[22 - 3]
    except (IndexError, ValueError):
        return None


def host_identity(proc: str = _PROC) -> dict[str, Any]:
    """What a registry entry records of the process that registers (JSON-able): ``host`` (hostname), ``boot_id``
    (the kernel's, changes at every boot), ``pid_ns`` (the pid namespace, e.g. ``pid:[4026531836]``) and
    ``pid_start`` (this process's start time, :func:`process_start`). {} where ``/proc`` does not give them all
    (not Linux): such an agent is never taken over without ``--replace``."""
    try:
        pid_ns = os.readlink(f"{proc}/self/ns/pid")
    except OSError:
        pid_ns = ""
    boot_id, start = _read(f"{proc}/sys/kernel/random/boot_id"), process_start(os.getpid(), proc)
    if not boot_id or not pid_ns or start is None:
        return {}
    return {"host": socket.gethostname(), "boot_id": boot_id, "pid_ns": pid_ns, "pid_start": start}


@dataclass(frozen=True)
class DeadOwner:
    """A registered agent whose process is provably dead: its ``pid`` and why (``gone``: no such process;
    ``reused``: the pid names a process started at another time)."""

    pid: int
    why: str


def dead_owner(info: Mapping[str, Any], here: Mapping[str, Any], proc: str = _PROC) -> DeadOwner | None:
    """The registry entry ``info`` of a rank's agent, judged from a process whose :func:`host_identity` is
    ``here``: a :class:`DeadOwner` when the entry was written on this host (same hostname, boot id and pid
    namespace) and its pid is gone or reused; None when it may be alive (another host, another boot or pid
    namespace, an entry without these facts, or the very process still running)."""
    if not here or any(info.get(k) != here[k] for k in ("host", "boot_id", "pid_ns")):
        return None
    pid, recorded = info.get("pid"), info.get("pid_start")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or not isinstance(recorded, int):
        return None
    start = process_start(pid, proc)
    if start is None:
        return DeadOwner(pid, "gone")
    return None if start == recorded else DeadOwner(pid, "reused")


def takeover_reason(ep_rank: int, info: Mapping[str, Any], dead: DeadOwner, *, by: str, age_ms: int,
                    ttl_ms: int) -> reasons.Reason:
    """The audited reason of a takeover: the text and its facts (``ep_rank``, the dead agent's ``agent_id`` and
    ``pid``, ``pid_state`` gone / reused, ``host``, its heartbeat ``age_ms`` / ``ttl_ms`` and the new actor ``by``)."""
    state = "is gone" if dead.why == "gone" else "names another process (start time differs)"
    text = (f"rank {int(ep_rank)}: agent {info.get('actor', info.get('agent_id', '?'))} on this host "
            f"({info.get('host', '?')}) is dead: pid {dead.pid} {state}; its heartbeat ({age_ms} ms ago, TTL "
            f"{ttl_ms} ms) had not lapsed; taken over by {by}")
    return reasons.Reason(text, {"ep_rank": int(ep_rank), "agent_id": str(info.get("agent_id", "")),
                                 "pid": dead.pid, "pid_state": dead.why, "host": str(info.get("host", "")),
                                 "heartbeat_age_ms": int(age_ms), "ttl_ms": int(ttl_ms), "by": by})


def audit_if_dead(store: Any, ep_rank: int, info: Mapping[str, Any], *, by: str, age_ms: int, ttl_ms: int) -> bool:
    """Whether a new agent ``by`` may take ``ep_rank`` over from its registered agent ``info`` (heartbeat fresh:
    ``age_ms`` / ``ttl_ms``) because that agent is provably dead (:func:`dead_owner`); if so the takeover is audited
    first (``takeover_dead_pid``, a note on the rank record, :func:`takeover_reason` its reason and detail)."""
    dead = dead_owner(info, host_identity())
    if dead is None:
        return False
    why = takeover_reason(ep_rank, info, dead, by=by, age_ms=age_ms, ttl_ms=ttl_ms)
    store.append_note(store.read(RANK, ep_rank), trigger=TAKEOVER, actor=by, reason=why.text, detail=why.detail,
                      table=RANK, ep_rank=ep_rank)
    log.warning("took over a dead agent's rank", ep_rank=ep_rank, pid=dead.pid, pid_state=dead.why)
    return True


def check_not_driven(store: Any, ep_rank: int, agent_id: str, *, replace: bool, by: str) -> None:
    """Refuse to take over a rank whose registered agent is alive (heartbeat within its TTL, not stopped, its
    process not provably dead: :func:`audit_if_dead`) unless ``replace``: :class:`~fdeplb.errors.StateError`
    naming it, nothing written. ``agent_id``: the starting agent's own id (its own registration never refuses)."""
    owner = store.rank_agent(ep_rank)
    if owner is None or owner == agent_id or replace:
        return
    who = store.rank_info().get(ep_rank, {})
    if who.get("stopped_ms"):  # it stopped (run's end): not a live agent
        return
    age, ttl = store.heartbeats().get(ep_rank, (0, 0))
    if ttl > 0 and not stale_of({ep_rank: (age, ttl)}) \
            and not audit_if_dead(store, ep_rank, who, by=by, age_ms=age, ttl_ms=ttl):
        raise StateError(f"rank {ep_rank} is driven by a live agent ({who.get('actor', owner)}, agent "
                         f"{owner}, heartbeat {age} ms ago, TTL {ttl} ms); pass --replace (replace=True) to "
                         f"supersede it, or stop it first")
