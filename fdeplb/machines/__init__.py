"""The state machines as data: the three tables, their state enums, and the ``transitions`` wrappers (no I/O)."""

from fdeplb.machines.model import CommitMachine, RecordModel, build_machine
from fdeplb.machines.tables import (
    CLUSTER,
    RANK,
    TABLES,
    WEIGHTS,
    ClusterState,
    Effect,
    Guard,
    GuardKind,
    MachineTable,
    RankState,
    StateEnum,
    TransitionSpec,
    WeightState,
    entry_work,
)

__all__ = [
    "CLUSTER",
    "RANK",
    "TABLES",
    "WEIGHTS",
    "ClusterState",
    "CommitMachine",
    "Effect",
    "Guard",
    "GuardKind",
    "MachineTable",
    "RankState",
    "RecordModel",
    "StateEnum",
    "TransitionSpec",
    "WeightState",
    "build_machine",
    "entry_work",
]
