"""The import graph of fdeplb/: no import circle among its modules, and no import that climbs the floors written
once, in docs/architecture.md's layer line (read from there, so the doc and this test cannot disagree). Every import
counts, function-level and ``TYPE_CHECKING`` ones included (import-linter's ``layers`` contract, done with ast).
And in tests/: no test module imports another (shared code lives in helpers modules, fixtures in conftest.py)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import fdeplb

ROOT = Path(fdeplb.__file__).resolve().parent
DOC = ROOT.parent / "docs" / "architecture.md"


def floors() -> dict[str, int]:
    """Top-level module or package name -> its floor (0 = ground), from the layer line under ``## Layers``."""
    layers = DOC.read_text().split("## Layers", 1)[1]
    line = re.search(r"```\n(.*?)\n```", layers, re.S).group(1)
    return {name.strip(): i for i, floor in enumerate(line.split("<-"))
            for name in re.split(r"[,/]", floor) if name.strip()}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str) -> str:
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports() -> dict[str, set[str]]:
    """fdeplb module -> the fdeplb modules it imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "fdeplb":
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == "fdeplb"]
            graph[name].update(t for t in map(_resolve, targets) if t != name)
    return graph


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "fdeplb"


def test_every_top_level_module_and_package_has_a_floor():
    rooms = {_room(m) for m in MODULES} - {"fdeplb"}
    assert sorted(rooms - set(floors())) == [], "give it a floor in docs/architecture.md's layer line"
    assert sorted(set(floors()) - rooms) == [], "the layer line names a module that does not exist"


def test_no_import_climbs_or_crosses_a_floor():
    floor = floors()
    offenders = sorted(f"{a} -> {b}" for a, targets in imports().items() for b in targets
                       if _room(a) != _room(b) and _room(b) != "fdeplb" and floor[_room(b)] >= floor[_room(a)])
    assert offenders == []


def test_no_import_circle():
    graph = imports()
    circles, done, path = [], set(), []

    def visit(module: str) -> None:
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if target in path:
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in done:
                visit(target)
        path.pop()
        done.add(module)

    for module in sorted(MODULES):
        if module not in done:
            visit(module)
    assert circles == []


def test_the_walk_sees_the_imports_it_judges():
    """The walk itself: a lazy import inside a function counts, and ``from pkg import module`` names the module."""
    graph = imports()
    assert "fdeplb.rounds.gating" in graph["fdeplb.rounds.members"]
    assert "fdeplb.weights.live" in graph["fdeplb.weights.backend"]  # imported inside a method
    assert "fdeplb.weights._paddle" in graph["fdeplb.weights.live"]  # from fdeplb.weights import _paddle
    assert floors()["errors"] == 0 and floors()["__main__"] == max(floors().values())


def test_no_test_module_imports_another():
    tests = ROOT.parent / "tests"
    offenders = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tests" \
                    and node.module.rpartition(".")[2].startswith("test_"):
                offenders.append(f"{path.relative_to(tests)}:{node.lineno}: {node.module}")
    assert offenders == []
