"""What the replay tests share (and the CLI's audit tests): the recordings under tests/replays/, reading and
mutating their lines (re-chained and renumbered after a change), and one fired round on a small cluster."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fdeplb.machines.tables import CLUSTER, RANK, WEIGHTS
from fdeplb.orchestration.handles import RecordHandle
from fdeplb.replay import chain_of
from fdeplb.store import PlanEntry, Store


REPLAYS = Path(__file__).parents[1] / "replays"


HAPPY = REPLAYS / "happy.jsonl"
RECORDINGS = sorted(REPLAYS.glob("*.jsonl"))
#: the same scenarios as recorded before audit records carried a ``detail`` (schema 1): they must still replay
SCHEMA1 = sorted((REPLAYS / "schema1").glob("*.jsonl"))


def lines_of(name: str = "happy") -> list[dict]:
    return [json.loads(x) for x in (REPLAYS / f"{name}.jsonl").read_text().splitlines()]


def index_of(lines, **match) -> int:
    return next(i for i, rec in enumerate(lines) if all(rec.get(k) == v for k, v in match.items()))


def rechain(lines: list[dict]) -> list[dict]:
    """Recompute every chain, as a careful forger would: what is left to catch it are the records' own checks."""
    chain = lines[0]["start"]["chain"]
    for rec in lines:
        if rec.get("type") == "audit":
            rec["chain"] = chain = chain_of(chain, rec)
    return lines


def renumber(lines):
    """Give the audit records increasing stream ids in file order and recompute the chain: a forger's finish."""
    base = lines[1]["id"].partition("-")[0]
    for seq, rec in enumerate(r for r in lines if r.get("type") == "audit"):
        rec["id"] = f"{base}-{seq}"
    return rechain(lines)


PLAN = "p0000000000000001"


def fire_round(store: Store, swapped: dict | None = None) -> None:
    """One full round on a one-rank cluster, committed through the real commit script (no agents, no paddle):
    every machine moves, with a stored plan whose content is made up; ``swapped``: what the cluster's ``swapped``
    says (reason, detail)."""
    lease = store.acquire_lease("test", 60_000)
    cluster = RecordHandle(store, CLUSTER, actor="test", fence=lease)
    rank = RecordHandle(store, RANK, 0, actor="test")
    weights = RecordHandle(store, WEIGHTS, 0, actor="test")
    store.save_plan(PlanEntry(plan_id=PLAN, round=1, policy="deepseek", old_plan_id="", topology={"bogus": 1},
                              expert_load=np.ones((1, 4), np.int64),
                              old_phy2log=np.arange(4, dtype=np.int64).reshape(1, 4),
                              new_phy2log=np.array([[3, 2, 1, 0]], np.int64), balancedness_before=0.5,
                              balancedness_after=1.0, moved_experts=4))
    cluster.fire("start", round_=1, changes={"round": 1})
    cluster.fire("plan")
    cluster.fire("load", plan_id=PLAN, changes={"plan_id": PLAN})
    rank.fire("stage", plan_id=PLAN, changes={"plan_id": PLAN})
    rank.fire("staged")
    cluster.fire("loaded")
    cluster.fire("commit")
    rank.fire("swap")
    rank.fire("swapped")
    cluster.fire("swapped", **(swapped or {}))
    cluster.fire("release")
    rank.fire("finish")
    weights.fire("update")
    weights.fire("updated", plan_id=PLAN, changes={"plan_id": PLAN})  # an update reloads the current placement
