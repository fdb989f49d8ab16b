"""Thin ``transitions`` wrappers around the tables: the commit happens before memory changes.

A :class:`RecordModel` mirrors one Redis record (state + version). :func:`build_machine` attaches it to a
``transitions.Machine`` built from a :class:`~fdeplb.machines.tables.MachineTable` *at the record's current state*:
``add_model`` writes ``initial`` to the model's plain ``state`` attribute only, so attaching never reaches Redis.

When a trigger fires, ``transitions`` checks it is legal from the current state (else ``MachineError``, turned
into :class:`~fdeplb.errors.IllegalTransitionError`), runs ``prepare``/conditions/``before`` callbacks (which have no
side effects), then calls :meth:`CommitTransition._change_state`. That method first calls the model's
``commit_hook``, which performs the atomic Redis commit and raises a typed :class:`~fdeplb.errors.StateError` if it is refused.
Only after a successful commit do ``on_exit``, the in-memory state change, ``on_enter`` and ``after`` run.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from transitions import Machine, MachineError, Transition

from fdeplb.errors import IllegalTransitionError
from fdeplb.machines.tables import MachineTable, TransitionSpec

# transitions logs every state entry at INFO; paddle configures the root logger, which would print them all.
logging.getLogger("transitions").setLevel(logging.WARNING)

#: commit hook: (model, spec, event kwargs) -> None; raises StateError when the commit is refused.
CommitHook = Callable[["RecordModel", TransitionSpec, dict[str, Any]], None]


class CommitTransition(Transition):
    """A transition that commits to the store before it changes the model's in-memory state."""

    def _change_state(self, event_data):  # noqa: D401 - transitions' hook
        model = event_data.model
        spec = model.table.spec(self.source, event_data.event.name)
        model.commit_hook(model, spec, dict(event_data.kwargs))
        super()._change_state(event_data)


class CommitMachine(Machine):
    """``transitions.Machine`` whose transitions commit first (see :class:`CommitTransition`)."""

    transition_cls = CommitTransition


class RecordModel:
    """In-memory mirror of one record of a table: ``state`` and ``version`` as last read or committed."""

    def __init__(self, table: MachineTable, key: str, state: str, version: int, commit: CommitHook) -> None:
        self.table = table
        self.key = key
        self.version = version
        self.commit_hook = commit  # not named after a trigger: transitions binds triggers as model attributes
        self.state = state  # overwritten by add_model with the same value; never written to Redis from here

    def fire(self, trigger: str, **kwargs: Any) -> str:
        """Fire ``trigger`` with keyword arguments for the commit hook; returns the new state.

        Raises :class:`IllegalTransitionError` when the trigger is not legal from the current state, or the
        commit hook's :class:`~fdeplb.errors.StateError` when Redis refuses it. The model is unchanged then.
        """
        try:
            self.trigger(trigger, **kwargs)  # type: ignore[attr-defined]  # added by transitions
        except MachineError as exc:
            raise IllegalTransitionError(f"{self.table.name} {self.key}: {exc.value}") from None
        except AttributeError as exc:
            if trigger not in self.table.triggers:
                raise IllegalTransitionError(f"{self.table.name}: unknown trigger {trigger!r}") from None
            raise exc
        return self.state


def build_machine(table: MachineTable, model: RecordModel) -> CommitMachine:
    """Attach ``model`` to a machine built from ``table`` at the model's current state (no auto transitions)."""
    return CommitMachine(
        model=model,
        states=list(table.states),
        transitions=table.transition_dicts(),
        initial=model.state,
        auto_transitions=False,
        send_event=True,
        ignore_invalid_triggers=False,
    )
