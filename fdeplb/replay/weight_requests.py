"""The weight requests of a replay: which request each rank's weight-status record carries out, which were
withdrawn, and the ``withdrawn`` guard of the WEIGHTS table's cancel transitions, checked with no Redis.

``store/lua/weights_cancel.lua`` withdraws a weight clear / update (the ``weights_cancelled`` note, whose
``detail.request`` names it) only while no rank applied it; a rank's ``cancel`` / ``cancel_to_cleared`` then
returns it to the state its clear / update came from (``commit.lua``'s ``withdrawn`` guard: the record's request was
withdrawn and its ``prior`` is the guard's state). The replay holds, per weight-status key, the state its last
clear / update came from and the request it names (``detail.request``, :func:`fdeplb.rounds.reasons.
request_of`; None in a recording written before it was recorded), and checks:

- a ``weights_cancelled`` note names a request no rank applied (no ``cleared`` / ``updated`` / ``update_failed`` of a
  key carrying it out);
- a cancel transition's key came from the guard's state, and its request was withdrawn before (or, without request
  numbers, a ``weights_cancelled`` note came after the key began its request).

A key whose clear / update is before the recording's start is not checked. :class:`~fdeplb.errors.ReplayError`
names the line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from fdeplb.errors import ReplayError
from fdeplb.machines.tables import Guard

if TYPE_CHECKING:
    from fdeplb.replay.recording_format import AuditLine

__all__ = ["WeightRequests"]

#: the weight-status triggers that begin carrying out a request, and those that finish it (the request applied)
BEGIN = frozenset({"clear", "update"})
APPLIED = frozenset({"cleared", "updated", "update_failed"})


@dataclass
class _Carried:
    prior: str  # the state its clear / update came from
    request: int | None
    where: str
    withdrawn: bool = False  # a weights_cancelled note came since it began
    applied: str = ""  # where it applied it


class WeightRequests:
    """Per weight-status key, the request it carries out; the requests withdrawn. ``request_of(line)`` reads a
    record's request (a :meth:`_Replay._detail` over :func:`~fdeplb.rounds.reasons.request_of`)."""

    def __init__(self, request_of: Callable[["AuditLine"], int | None]) -> None:
        self.request_of = request_of
        self.carried: dict[str, _Carried] = {}
        self.withdrawn: dict[int, str] = {}  # request -> where its weights_cancelled note is

    def transition(self, line: AuditLine) -> None:
        """A weight-status transition that committed (after the table's and guards' checks)."""
        rec = line.record
        if rec["trigger"] in BEGIN:
            self.carried[rec["key"]] = _Carried(rec["from"], self.request_of(line), line.where)
        elif rec["trigger"] in APPLIED:
            if rec["key"] in self.carried:
                self.carried[rec["key"]].applied = line.where
        else:  # a cancel: the key carries nothing out any more
            self.carried.pop(rec["key"], None)

    def cancelled(self, line: AuditLine) -> None:
        """A ``weights_cancelled`` note: no rank applied its request."""
        n = self.request_of(line)
        if n is None:
            raise ReplayError(f"{line.where}: weights_cancelled without the request it withdraws (detail.request)")
        for key, held in sorted(self.carried.items()):
            if held.request == n and held.applied:
                raise ReplayError(f"{line.where}: weight request {n} withdrawn, but {key} applied it "
                                  f"({held.applied}): a request is cancelled only while no rank applied it")
        self.withdrawn[n] = line.where
        for held in self.carried.values():
            if not held.applied:
                held.withdrawn = True

    def guard(self, line: AuditLine, guard: Guard) -> str:
        """The ``withdrawn`` guard of a cancel transition: "" when it held, else why not."""
        key = line.record["key"]
        held = self.carried.get(key)
        if held is None:  # its clear / update is before the recording's start
            return ""
        if held.prior != guard.state:
            return f"{key} came from {held.prior} ({held.where}), not {guard.state}"
        named = self.request_of(line)
        if held.request is not None and named is not None and named != held.request:
            return f"{key} carries out weight request {held.request}, the cancel names {named}"
        if held.request is not None and held.request not in self.withdrawn:
            return f"weight request {held.request} of {key} was not withdrawn (no weights_cancelled note for it)"
        if held.request is None and not held.withdrawn:
            return f"no weights_cancelled note since {key} began its request ({held.where})"
        return ""
