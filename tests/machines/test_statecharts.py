"""State diagrams: generated from the tables, deterministic, and the committed ones are current."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from fdeplb.cli import main
from fdeplb.cli.statecharts import default_dir, render_svg, stale_files, write_statecharts
from fdeplb.errors import DependencyError, InputError
from fdeplb.machines import diagrams
from fdeplb.machines.tables import CLUSTER, RANK, TABLES, WEIGHTS, TransitionSpec

COMMITTED = Path(__file__).resolve().parents[2] / "statecharts"


@pytest.fixture
def charts(tmp_path) -> Path:
    """A copy of the committed statecharts/ folder (tests change files in it)."""
    out = tmp_path / "charts"
    shutil.copytree(COMMITTED, out)
    return out


def test_committed_statecharts_are_current(capsys):
    assert default_dir() == COMMITTED
    assert main(["statecharts", "--check"]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in COMMITTED.iterdir()) == sorted(
        f"{t}.{ext}" for t in TABLES for ext in ("mmd", "dot", "svg"))


@pytest.mark.parametrize("table", list(TABLES.values()), ids=list(TABLES))
def test_every_state_and_transition_is_drawn(table):
    mmd, dot = diagrams.mermaid(table), diagrams.dot(table)
    assert mmd == diagrams.mermaid(table) and dot == diagrams.dot(table)  # deterministic
    assert mmd.startswith("---\ntitle: ") and "\nstateDiagram-v2\n" in mmd
    for state in table.states:
        label = f"{state} [{table.codes[state]}]"
        assert f'state "{label}" as {state}\n' in mmd
        assert f'"{state}" [label="{label}", fillcolor="{diagrams.CODE_COLORS[table.codes[state]]}"]' in dot
    for spec in table.transitions:
        for src in spec.sources:
            # parallel edges (updated | cancel) share one Mermaid line, their labels joined by " | "
            edges = [line.split(": ", 1)[1].split(" | ") for line in mmd.splitlines()
                     if line.startswith(f"  {src} --> {spec.dest}: ")]
            assert len(edges) == 1 and diagrams.transition_label(spec) in edges[0], (src, spec.trigger, edges)
            assert f'"{src}" -> "{spec.dest}" [label="{spec.trigger}' in dot
    assert f"[*] --> {table.initial}" in mmd and f'__initial -> "{table.initial}";' in dot


def test_labels_carry_codes_guards_and_effect():
    mmd = diagrams.mermaid(CLUSTER)
    assert 'state "LOAD_SUCC [2]" as LOAD_SUCC' in mmd
    assert "FREE --> COLLECTING: start [ranks_in(IDLE) & weights_in(NORMAL)]" in mmd
    assert "LOAD_SUCC --> SWAPPING: commit [ranks_in(LOADED, same plan)] / set_placement" in mmd
    assert "COLLECTING --> FREE: abort | operator_abort\n" in mmd  # no guard, no brackets; one edge, both triggers
    dot = diagrams.dot(RANK)
    assert '"IDLE" -> "LOADING" [label="stage\\n[cluster_in(LOADING, same plan)]"];' in dot
    assert 'state "CLEARED [-2]" as CLEARED' in diagrams.mermaid(WEIGHTS)
    spec = TransitionSpec("go", ("A",), "B", effect="set_placement")
    assert diagrams.transition_label(spec) == "go / set_placement"


def test_changed_table_makes_check_fail(charts):
    assert stale_files(charts) == []
    changed = dataclasses.replace(WEIGHTS, codes={**WEIGHTS.codes, "CLEARED": -3}, _by_key={})
    problems = stale_files(charts, {"weights": changed})
    assert [Path(p.split(":")[0]).name for p in problems] == ["weights.mmd", "weights.dot", "weights.svg"]
    assert "rendered from another DOT source" in problems[-1]


def test_check_names_the_stale_file(charts, capsys):
    (charts / "rank.mmd").write_text((charts / "rank.mmd").read_text() + "%% edited by hand\n")
    assert main(["statecharts", "--check", "--out", str(charts)]) == 1
    err = capsys.readouterr().err
    assert f"stale: {charts / 'rank.mmd'}: differs" in err
    assert "cluster" not in err and "rank.dot" not in err


def test_check_reads_svg_stamp_not_bytes(charts, capsys):
    svg = charts / "cluster.svg"
    svg.write_text(svg.read_text().replace("FREE [0]", "FREE [0] "))  # another Graphviz version: other bytes
    assert stale_files(charts) == []
    svg.write_text(svg.read_text().replace(diagrams.SVG_STAMP, "no-stamp"))
    assert stale_files(charts) == [f"{svg}: has no fdeplb-dot-sha256 stamp"]
    (charts / "weights.dot").unlink()
    assert main(["statecharts", "--check", "--out", str(charts)]) == 1
    assert f"{charts / 'weights.dot'}: missing" in capsys.readouterr().err


def test_write_keeps_current_svgs_without_dot(charts, tmp_path):
    (charts / "cluster.dot").unlink()
    assert write_statecharts(charts, dot_binary="fdeplb-no-such-dot") == [charts / "cluster.dot"]
    assert stale_files(charts) == []
    with pytest.raises(DependencyError, match="apt-get install graphviz"):
        write_statecharts(tmp_path / "fresh", dot_binary="fdeplb-no-such-dot")
    assert (tmp_path / "fresh" / "cluster.mmd").read_text() == diagrams.mermaid(CLUSTER)


def test_stamp_replaces_an_old_stamp():
    svg = '<?xml version="1.0"?>\n<svg></svg>\n'
    once = diagrams.stamp_svg(svg, "digraph a {}")
    twice = diagrams.stamp_svg(once, "digraph b {}")
    assert diagrams.svg_stamp(once) == diagrams.dot_digest("digraph a {}")
    assert diagrams.svg_stamp(twice) == diagrams.dot_digest("digraph b {}")
    assert twice.count(diagrams.SVG_STAMP) == 1 and twice.startswith('<?xml version="1.0"?>\n<!-- ')
    with pytest.raises(InputError):
        diagrams.stamp_svg("not svg", "digraph a {}")


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot binary is not installed")
def test_render_svg_is_stamped(tmp_path):
    source = diagrams.dot(WEIGHTS)
    svg = render_svg(source)
    assert diagrams.svg_stamp(svg) == diagrams.dot_digest(source)
    assert "CLEARED [&#45;2]" in svg or "CLEARED [-2]" in svg
    written = write_statecharts(tmp_path / "out")
    assert len(written) == 3 * len(TABLES) and stale_files(tmp_path / "out") == []
    assert write_statecharts(tmp_path / "out") == []  # nothing changes on a second run


def test_statecharts_without_graphviz_write_what_they_can_and_say_what_they_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no `dot` anywhere
    out = tmp_path / "charts"
    assert main(["statecharts", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in TABLES:
        assert (out / f"{name}.mmd").is_file() and (out / f"{name}.dot").is_file()
        assert not (out / f"{name}.svg").exists()
        assert f"skipped {out / (name + '.svg')}" in printed
