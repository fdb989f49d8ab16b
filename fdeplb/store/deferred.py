"""Calls laid out now and sent later, several in one pipeline (one round trip): :class:`PendingCall`, the script
calls as ``EVALSHA`` (:meth:`DeferredCalls._deferred_script`), :meth:`DeferredCalls.send` and the outcome of each
call, typed as the immediate call's would be.

Uses from :class:`~fdeplb.store.base.StoreBase`: ``_client``, ``url``, ``_loaded`` (the scripts this store loaded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import redis

from fdeplb.errors import StateError, StoreError
from fdeplb.store.connection import redis_errors as _redis_errors
from fdeplb.store.scripts import CommitCall


@dataclass(frozen=True)
class PendingCall:
    """One Redis call laid out now and sent later in a pipeline with others: before the ``XREAD`` of the next
    :meth:`Store.wait_view` (a rank agent's step's last write then costs no round trip of its own, and is in
    Redis before the agent blocks), or with the calls :meth:`Store.send` is given (a commit and a read that do not
    depend on each other: one round trip). Made by :meth:`Store.deferred_commit`, :meth:`Store.deferred_publish`
    and :meth:`Store.deferred_plan_read`.

    Nothing is known to be done until the pipeline returns the call's outcome (the value, or the typed error the
    immediate call would raise); a round trip that fails (Redis unavailable) leaves it unknown, and the reconcile
    loop's next step does the work again (every such write is idempotent or version-checked)."""

    what: str
    """What the call is, for logs and errors (``rank stage on rank:3``, ``load window of rank 3``)."""
    queue: Callable[[Any], Any]
    """Adds the call, one command, to a redis-py pipeline."""
    outcome: Callable[[Any], Any]
    """The command's reply (a redis-py exception object where it failed) -> the call's result; raises the typed
    error of a refusal."""
    then: Callable[[Any], None] | None = None
    """Called with the result once the call succeeded (e.g. a handle remembering the record a commit left)."""


class DeferredCalls:
    """Sending :class:`PendingCall` s in one round trip (see the module doc)."""

    def send(self, writes: list[PendingCall]) -> list[Any]:
        """Send ``writes`` now, in order, in one round trip (no wait). Returns each write's outcome: its result, or
        the typed :class:`~fdeplb.errors.StateError` / :class:`~fdeplb.errors.StoreError` it met (returned, not
        raised; one write's refusal does not stop the next). :class:`RedisUnavailableError` when the round trip
        fails (then their fate is unknown)."""
        if not writes:
            return []
        pipe = self._client.pipeline(transaction=False)
        for w in writes:
            w.queue(pipe)
        return self._write_outcomes(writes, pipe.execute(raise_on_error=False))

    def _deferred_script(self, what: str, script: Any, call: CommitCall, parse: Callable[[Any], Any]) -> PendingCall:
        """A script call as a :class:`PendingCall`: sent as ``EVALSHA`` (on a pipeline redis-py's ``Script`` would
        first ask ``SCRIPT EXISTS``, a round trip of its own), the script loaded once per store beforehand; a
        server that lost it since (restarted) gets it loaded and the call run again, after the pipeline."""
        if script.sha not in self._loaded:
            self._client.script_load(script.script)
            self._loaded.add(script.sha)

        def outcome(reply: Any) -> Any:
            if isinstance(reply, redis.exceptions.NoScriptError):
                reply = script(keys=call.keys, args=call.args)
            elif isinstance(reply, Exception):
                raise reply
            return parse(reply)

        # execute_command, not pipe.evalsha: redis-py's cluster pipeline refuses the named script methods
        return PendingCall(what, lambda pipe: pipe.execute_command("EVALSHA", script.sha, len(call.keys), *call.keys,
                                                                   *call.args), outcome)

    def _write_outcomes(self, calls: list[PendingCall], replies: list[Any]) -> list[Any]:
        outcomes: list[Any] = []
        for c, reply in zip(calls, replies):
            try:
                with _redis_errors(self.url):
                    result = c.outcome(reply)
            except (StateError, StoreError) as err:
                outcomes.append(err)
                continue
            outcomes.append(result)
            if c.then is not None:
                c.then(result)
        return outcomes
