"""Hostile recordings: every malformed or forged file makes ``fdeplb replay`` exit 1 with one ``error: line N``
naming the line, never a traceback and never "replay OK" (found by the recordings QA pass)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fdeplb.cli import main

HAPPY = Path(__file__).parents[1] / "replays" / "happy.jsonl"
TAKEOVER = Path(__file__).parents[1] / "replays" / "takeover.jsonl"


def _lines(path: Path = HAPPY) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _set(index: int, *path: str, value):
    def mutate(lines):
        target = lines[index]
        for name in path[:-1]:
            target = target[name]
        target[path[-1]] = value
        return lines
    return mutate


def _header_from(other: Path):
    def mutate(lines):
        return [_lines(other)[0]] + lines[1:]
    return mutate


def _forge_plan(name: str, value):
    def mutate(lines):
        plan = next(x for x in lines if x.get("type") == "plan")
        plan[name] = value
        return lines
    return mutate


MUTATIONS = {  # name: (mutate the parsed happy recording, line the error names, pattern)
    "trigger is a list": (_set(5, "trigger", value=[]), 6, r"field trigger is list"),
    "reason is null": (_set(5, "reason", value=None), 6, r"field reason is NoneType"),
    "config is text": (_set(0, "config", value="x"), 1, r"config"),
    "start records is a list": (_set(0, "start", "records", value=[]), 1, r"records"),
    "start record is text": (_set(0, "start", "records", "cluster", value="FREE"), 1, r"cluster"),
    "start version is text": (_set(0, "start", "records", "cluster", "version", value="x"), 1, r"version"),
    "start state unknown": (_set(0, "start", "records", "cluster", "state", value="BOGUS"), 1, r"BOGUS"),
    "start placement is text": (_set(0, "start", "placement", value="x"), 1, r"placement"),
    "contents plans is a number": (_set(0, "contents", "plans", value=5), 1, r"plans"),
    "missing is text": (_set(0, "missing", value="x"), 1, r"missing"),
    "schema is true": (_set(0, "schema", value=True), 1, r"schema"),
    "header of another cluster": (_header_from(TAKEOVER), 1, r"first_id"),
    "plan balancedness forged": (_forge_plan("balancedness_after", 0.12), 4, r"balancedness_after"),
    "plan moved experts forged": (_forge_plan("moved_experts", 3), 4, r"moved_experts"),
}


def _replay_fails_at(path: Path, line: int, pattern: str, capsys) -> None:
    assert main(["replay", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "replay OK" not in out
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: line {line}"), err
    assert re.search(pattern, err), err


@pytest.mark.parametrize("name", MUTATIONS)
def test_malformed_recording_names_its_line(name, tmp_path, capsys):
    mutate, line, pattern = MUTATIONS[name]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in mutate(_lines())) + "\n")
    _replay_fails_at(path, line, pattern, capsys)


GOOD = HAPPY.read_bytes().splitlines(keepends=True)
RAW = {  # name: (bytes of the file, line the error names, pattern)
    "not UTF-8 at the start": (b"\xff\xfe garbage\n", 1, r"UTF-8"),
    "not UTF-8 on line 6": (b"".join(GOOD[:5]) + b'{"type": "audit", "x": "\xff"}\n', 6, r"UTF-8"),
    "nested 100000 deep": (GOOD[0] + b"[" * 100_000 + b"]" * 100_000 + b"\n", 2, r"not JSON"),
    "a 5000-digit number": (GOOD[0] + b'{"type":"snapshot","round":' + b"9" * 5000 + b"}\n", 2, r"not JSON"),
    "a shape whose product wraps to 0": (GOOD[0] + b'{"type":"snapshot","round":1,"expert_load":{"dtype":"int64",'
                                         b'"shape":[4294967296,4294967296],"data":[]}}\n', 2, r"shape"),
    "a shape above int64": (GOOD[0] + b'{"type":"snapshot","round":1,"expert_load":{"dtype":"int64",'
                            b'"shape":[0,100000000000000000000000],"data":[]}}\n', 2, r"shape"),
}


@pytest.mark.parametrize("name", RAW)
def test_unreadable_bytes_name_their_line(name, tmp_path, capsys):
    data, line, pattern = RAW[name]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(data)
    _replay_fails_at(path, line, pattern, capsys)
