"""A stored plan, :class:`PlanEntry`: its fields, its Redis hash (:meth:`PlanEntry.to_fields` /
:meth:`PlanEntry.from_fields`, the arrays as dtype + shape + raw bytes through :mod:`fdeplb.store.arrays`) and its
JSON form in a recording (:meth:`PlanEntry.to_json` / :meth:`PlanEntry.from_json`); and :func:`json_text`, the
canonical JSON of a stored document.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from fdeplb.errors import CorruptRecordError, InputError
from fdeplb.store import arrays


@dataclass(frozen=True)
class PlanEntry:
    """A stored plan, hash ``fdeplb:{c}:plan:<plan_id>`` (write-once: plans are content-addressed)."""

    plan_id: str
    """Content hash of (expert_load, old_phy2log, policy, topology); see :func:`fdeplb.placement.plan_digest`."""
    round: int
    """Round that first planned it."""
    policy: str
    """Placement policy (a name of :data:`fdeplb.placement.POLICIES`)."""
    old_plan_id: str
    """Placement the plan starts from ("" = initial)."""
    topology: dict
    """num_layers, num_logical_experts, num_physical_experts, ep_size, num_nodes, num_groups."""
    expert_load: np.ndarray
    """int64 [L, E]: the round's load snapshot."""
    old_phy2log: np.ndarray
    """int64 [L, P]: the placement before the plan."""
    new_phy2log: np.ndarray
    """int64 [L, P]: the planned placement."""
    balancedness_before: float
    """Mean over layers of mean/max GPU load under ``old_phy2log`` for this load, in (0, 1]."""
    balancedness_after: float
    """The same under ``new_phy2log``."""
    moved_experts: int
    """Experts present on a GPU in the new placement but not the old (multiset difference, summed)."""
    generation: int = 0
    """The cluster's membership generation the plan was made under (its round's start)."""

    def live_ranks(self, ep_size: int) -> tuple[int, ...]:
        """The ranks it is routed over: its round's members (``topology["live_ranks"]``; every rank without)."""
        return tuple(int(r) for r in self.topology.get("live_ranks", range(ep_size)))

    def to_fields(self) -> dict[str, Any]:
        """The plan as the fields of its Redis hash: the three arrays as int64 dtype + shape + bytes
        (:func:`fdeplb.store.arrays.encode`), the rest as text (``topology`` as canonical JSON, the balancedness
        figures to 6 decimals)."""
        out: dict[str, Any] = {}
        for name in PLAN_ARRAYS:
            out.update(arrays.encode(name, np.asarray(getattr(self, name), dtype=np.int64)))
        out.update({
            "plan_id": self.plan_id, "round": str(self.round), "policy": self.policy, "old_plan_id": self.old_plan_id,
            "topology": json_text(self.topology), "balancedness_before": f"{self.balancedness_before:.6f}",
            "balancedness_after": f"{self.balancedness_after:.6f}", "moved_experts": str(self.moved_experts),
            "generation": str(self.generation),
        })
        return out

    @classmethod
    def from_fields(cls, key: str, raw: Mapping[str, Any], plan_id: str = "") -> "PlanEntry":
        """The plan stored in hash ``key`` (``raw``: its fields as read, str names, bytes or str values); the inverse
        of :meth:`to_fields`. ``plan_id`` is the id when the hash has no ``plan_id`` field.

        Raises :class:`CorruptRecordError` naming ``key`` when an array is missing or does not decode, or a text
        field does not parse. The arrays are only decoded here: their dtype, shape and range against the cluster's
        configuration are the store's check (it knows the configuration)."""
        arrs = {}
        for name in PLAN_ARRAYS:
            try:
                arrs[name] = arrays.decode(name, raw)
            except (InputError, ValueError, TypeError) as exc:
                raise CorruptRecordError(f"{key}: {exc}", key=key) from None
        missing = [n for n, a in arrs.items() if a is None]
        if missing:
            raise CorruptRecordError(f"{key}: stored plan lacks {', '.join(missing)}", key=key)
        text = {k: v.decode(errors="replace") if isinstance(v, bytes) else str(v) for k, v in raw.items()
                if k in _PLAN_TEXT}
        try:
            return cls(
                plan_id=text.get("plan_id", plan_id), round=int(text.get("round", "")), policy=text.get("policy", ""),
                old_plan_id=text.get("old_plan_id", ""), topology=json.loads(text.get("topology", "{}")),
                balancedness_before=float(text.get("balancedness_before", "nan")),
                balancedness_after=float(text.get("balancedness_after", "nan")),
                moved_experts=int(text.get("moved_experts", "")), generation=int(text.get("generation", "0")),
                **arrs)
        except ValueError as exc:  # JSONDecodeError is a ValueError
            raise CorruptRecordError(f"{key}: {exc}", key=key) from None


    def to_json(self) -> dict[str, Any]:
        """This plan as JSON: a recording's ``plan`` line without its ``type`` (docs/recordings.md), every field,
        the arrays as :func:`fdeplb.array_json.array_json` objects."""
        from fdeplb.array_json import array_json

        return {"plan_id": self.plan_id, "round": self.round, "policy": self.policy, "old_plan_id": self.old_plan_id,
                "topology": self.topology, "balancedness_before": self.balancedness_before,
                "balancedness_after": self.balancedness_after, "moved_experts": self.moved_experts,
                "generation": self.generation, "expert_load": array_json(self.expert_load), "old_phy2log": array_json(self.old_phy2log),
                "new_phy2log": array_json(self.new_phy2log)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str, error: type[InputError] = InputError) -> PlanEntry:
        """Inverse of :meth:`to_json` (other keys, such as a line's ``type``, are ignored), strictly typed:
        ``plan_id``, ``policy`` and ``old_plan_id`` (default "") text, ``round``, ``moved_experts`` and ``generation``
        (default 0: a plan line written before it was exported) integers
        (:func:`fdeplb.checks.check_int`), the balancedness figures numbers, ``topology`` an object, the arrays
        int64 (:func:`fdeplb.array_json.array_from_json`). Raises ``error`` (default
        :class:`~fdeplb.errors.InputError`) with a message that starts with ``where`` and names the field."""
        from fdeplb.array_json import array_from_json
        from fdeplb.checks import check_int

        def typed(name: str, kinds: tuple[type, ...], want: str, default: Any = None) -> Any:
            value = obj.get(name, default)
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise error(f"{where}: not a plan: {name} is {type(value).__name__}, not {want}")
            return value

        plan_id = typed("plan_id", (str,), "text")
        arrays = {name: array_from_json(obj.get(name), f"{where}: plan {plan_id} {name}", error)
                  for name in ("expert_load", "old_phy2log", "new_phy2log")}
        return cls(plan_id=plan_id, round=check_int(obj.get("round"), f"{where}: not a plan: round", error=error),
                   policy=typed("policy", (str,), "text"), old_plan_id=typed("old_plan_id", (str,), "text", ""),
                   topology=dict(typed("topology", (dict,), "an object")),
                   balancedness_before=float(typed("balancedness_before", (int, float), "a number")),
                   balancedness_after=float(typed("balancedness_after", (int, float), "a number")),
                   moved_experts=check_int(obj.get("moved_experts"), f"{where}: not a plan: moved_experts",
                                           error=error),
                   generation=check_int(obj.get("generation", 0), f"{where}: not a plan: generation", lo=0,
                                        error=error), **arrays)


#: a stored plan's arrays (each kept as dtype + shape + bytes) and its text fields
PLAN_ARRAYS = ("expert_load", "old_phy2log", "new_phy2log")
_PLAN_TEXT = frozenset({"plan_id", "round", "policy", "old_plan_id", "topology", "balancedness_before",
                        "balancedness_after", "moved_experts", "generation"})


def json_text(obj: object) -> str:
    """Canonical JSON text (sorted keys) of a stored document."""
    return json.dumps(obj, sort_keys=True)
