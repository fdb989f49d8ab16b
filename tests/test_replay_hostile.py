"""Hostile recordings: every malformed or forged file makes ``fdeplb replay`` exit 1 with one ``error: line N``
naming the line, never a traceback and never "replay OK" (found by the recordings QA pass)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fdeplb.cli import main

HAPPY = Path(__file__).parent / "replays" / "happy.jsonl"


def _replay_fails_at(path: Path, line: int, pattern: str, capsys) -> None:
    assert main(["replay", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "replay OK" not in out
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: line {line}"), err
    assert re.search(pattern, err), err


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
