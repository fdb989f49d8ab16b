"""Package faces: every package says its concern and exports exactly its public names; no package reaches into
another's private module; no state name is written as a string outside fdeplb/machines/; only fdeplb/store/ talks
to Redis (httpx's tests/test_exported_members.py is the model)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import fdeplb
from fdeplb.machines.tables import TABLES

ROOT = Path(fdeplb.__file__).resolve().parent

PUBLIC = {
    "fdeplb": ["__version__"],
    "fdeplb.api": ["ApiSettings", "Credentials", "create_app", "create_router", "load_credentials"],
    "fdeplb.data": ["BUNDLED_TRACE", "ORIGINAL_NAME", "extract_bundled_trace", "source_note"],
    "fdeplb.cli": ["build_parser", "main"],
    "fdeplb.machines": [
        "CLUSTER", "FASTDEPLOY_STATUS_NAMES", "MEMBERSHIP", "RANK", "TABLE_OF_LABEL", "TABLES", "WEIGHTS", "ClusterState",
        "CommitMachine", "Effect", "Guard", "GuardKind", "MachineTable", "MemberState", "RankState", "RecordModel", "StateEnum", "TransitionSpec", "WeightState", "build_machine",
        "entry_work"],
    "fdeplb.orchestration": ["Coordinator", "Fired", "RankAgent", "RecordHandle", "default_planner", "init_cluster"],
    "fdeplb.replay": ["ReplayError", "ReplayReport", "check_gates", "check_plans", "chain_of", "parse_lines",
                      "read_export", "rebuild", "replay", "replay_file", "whatif"],
    "fdeplb.rounds": ["GateDecision", "Planner", "Reason", "RoundOutcome", "decide", "default_planner", "live_mask",
                      "mean_balancedness", "plan_round", "replacement", "round_outcome"],
    "fdeplb.sim": ["LocalCluster", "integral_load", "new_cluster_id", "rank_share", "temp_workdir"],
    "fdeplb.store": [
        "AuditRecord", "ClusterConfig", "ClusterRecord", "CommitResult", "Cursor", "Deadlines", "EmbeddedRedis",
        "LeaseInfo", "LoadWindow", "MemberRecord", "PendingCall", "PlacementEntry", "PlanEntry", "RankRecord", "Store", "WeightRecord"],
}


def packages() -> list[str]:
    names = ["fdeplb"]
    names += [m.name for m in pkgutil.walk_packages([str(ROOT)], prefix="fdeplb.") if m.ispkg]
    return sorted(names)


@pytest.mark.parametrize("name", packages())
def test_every_package_has_a_docstring_and_an_explicit_all(name):
    module = importlib.import_module(name)
    assert module.__doc__ and module.__doc__.strip(), f"{name} has no docstring"
    assert isinstance(getattr(module, "__all__", None), list), f"{name} has no __all__"
    for exported in module.__all__:
        assert hasattr(module, exported), f"{name}.__all__ names {exported}, which it does not define"


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_names_are_pinned(name):
    assert sorted(importlib.import_module(name).__all__) == sorted(PUBLIC[name])


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _package_of(path: Path) -> str:
    return ".".join(("fdeplb", *path.relative_to(ROOT).parent.parts))


def test_no_import_of_another_packages_private_module():
    offenders = []
    for path, tree in _modules():
        own = _package_of(path)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                for i, part in enumerate(parts):
                    if part.startswith("_") and not part.startswith("__") and ".".join(parts[:i]) != own:
                        offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert not offenders, offenders


def test_no_state_name_literal_outside_the_machines():
    states = {s.value for t in TABLES.values() for s in t.states}
    offenders = []
    for path, tree in _modules():
        if path.relative_to(ROOT).parts[0] == "machines":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in states:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not offenders, offenders


def test_only_the_store_talks_to_redis():
    offenders = []
    for path, tree in _modules():
        if path.relative_to(ROOT).parts[0] == "store":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "redis" for a in node.names):
                offenders.append(str(path.relative_to(ROOT)))
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "redis":
                offenders.append(str(path.relative_to(ROOT)))
            if isinstance(node, ast.Attribute) and node.attr == "client":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: .client")
    assert not offenders, offenders


def test_no_two_modules_share_a_file_name():
    seen: dict[str, Path] = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "__init__.py" or path.name == "__main__.py":
            continue
        assert path.name not in seen, f"{path.relative_to(ROOT)} and {seen[path.name].relative_to(ROOT)}"
        seen[path.name] = path
