"""``fdeplb statecharts``: write (or ``--check``) the state diagrams of the machine tables.

For every table (cluster, rank, weights) it writes ``<name>.mmd`` (Mermaid), ``<name>.dot`` (Graphviz source) and
``<name>.svg`` (rendered by Graphviz's ``dot`` binary, stamped with the sha256 of its DOT source). ``--check``
compares instead of writing: ``.mmd`` and ``.dot`` byte for byte, ``.svg`` by its stamp, so it needs no ``dot``
binary; it exits 1 naming every stale file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fdeplb.errors import DependencyError, InputError
from fdeplb.input_files import check_output, write_output
from fdeplb.machines import diagrams
from fdeplb.machines.diagrams import default_dir, render_svg
from fdeplb.machines.tables import TABLES, MachineTable

#: exit status of ``--check`` when a file is stale or missing
STALE_EXIT = 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("statecharts", help="write the machines' state diagrams (Mermaid, DOT, SVG)",
                       description=__doc__.replace("``", "`"))
    p.add_argument("--out", type=Path, default=None,
                   help="folder to write or check (default: statecharts/ of the checkout fdeplb runs from)")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if a file differs from what the tables produce now")
    p.set_defaults(handler=run)


def sources(table: MachineTable) -> dict[str, str]:
    """The text files of one table: ``{"<name>.mmd": mermaid, "<name>.dot": dot}``."""
    return {f"{table.name}.mmd": diagrams.mermaid(table), f"{table.name}.dot": diagrams.dot(table)}


def stale_files(out: Path, tables: dict[str, MachineTable] = TABLES) -> list[str]:
    """Problems of the diagrams in ``out``, one line each naming the file ([] when all are current)."""
    problems = []
    for table in tables.values():
        texts = sources(table)
        for name, text in texts.items():
            path = out / name
            if not path.is_file():
                problems.append(f"{path}: missing")
            elif path.read_bytes() != text.encode("utf-8"):
                problems.append(f"{path}: differs from what fdeplb/machines/tables.py produces")
        svg = out / f"{table.name}.svg"
        want = diagrams.dot_digest(texts[f"{table.name}.dot"])
        if not svg.is_file():
            problems.append(f"{svg}: missing")
        else:
            got = diagrams.svg_stamp(svg.read_text(encoding="utf-8", errors="replace"))
            if got != want:
                why = "has no fdeplb-dot-sha256 stamp" if got is None else "was rendered from another DOT source"
                problems.append(f"{svg}: {why}")
    return problems


def write_statecharts(out: Path, tables: dict[str, MachineTable] = TABLES, dot_binary: str = "dot",
                      skipped: list[str] | None = None) -> list[Path]:
    """Write every table's diagrams into ``out`` (created if needed); returns the files whose content changed.
    Without Graphviz: :class:`DependencyError`, or, given a ``skipped`` list, the SVGs are left out and one line
    per SVG not written is appended to it (the Mermaid and DOT files are written either way).

    An SVG whose stamp already matches its DOT source is kept as it is (its bytes depend on the Graphviz version,
    not on the table), so regenerating needs the ``dot`` binary only when a table changed.

    Raises:
        InputError: ``out`` is no folder and cannot be made one (a file, a device such as ``/dev/stdout``, a path
            under a file), or one of the files to write exists and is not a regular file (a FIFO, a device, a
            folder): checked before any file is written, so nothing is.
    """
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: is not a folder; name the folder to write the statecharts into")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError(f"--out {out}: cannot make the folder: {err.strerror}") from None
    for table in tables.values():  # every target before any write: a FIFO among them leaves all as they were
        for name in (*sources(table), f"{table.name}.svg"):
            check_output(out / name, "a statechart")
    changed = []
    for table in tables.values():
        texts = sources(table)
        for name, text in texts.items():
            path = out / name
            if not path.is_file() or path.read_bytes() != text.encode("utf-8"):
                write_output(path, text.encode("utf-8"), "a statechart")  # a FIFO there: refused, not waited on
                changed.append(path)
        dot_source = texts[f"{table.name}.dot"]
        svg = out / f"{table.name}.svg"
        if svg.is_file() and diagrams.svg_stamp(svg.read_text(encoding="utf-8", errors="replace")) \
                == diagrams.dot_digest(dot_source):
            continue
        try:
            write_output(svg, render_svg(dot_source, dot_binary).encode("utf-8"), "a statechart")
        except DependencyError as err:
            if skipped is None:
                raise
            skipped.append(f"{svg}: {err}")
            continue
        changed.append(svg)
    return changed


def run(args: argparse.Namespace) -> int:
    out = args.out if args.out is not None else default_dir()
    if args.check:
        problems = stale_files(out)
        for line in problems:
            print(f"stale: {line}", file=sys.stderr)
        if problems:
            print("regenerate with: fdeplb statecharts" + (f" --out {out}" if args.out is not None else ""),
                  file=sys.stderr)
            return STALE_EXIT
        print(f"statecharts in {out} match the tables")
        return 0
    skipped: list[str] = []
    changed = write_statecharts(out, skipped=skipped)
    for path in changed:
        print(f"wrote {path}")
    for line in skipped:
        print(f"skipped {line}")
    if not changed and not skipped:
        print(f"statecharts in {out} already match the tables")
    return 0
