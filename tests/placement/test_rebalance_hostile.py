"""Hostile inputs to ``fdeplb rebalance``: exit 2 with one ``error:`` line and nothing written, never a traceback
(found by the planning CLI QA pass)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fdeplb.cli import main
from fdeplb.placement import read_placement

ARGS = ["--num-replicas", "8", "--num-gpus", "2"]


@pytest.fixture
def load(tmp_path):
    path = tmp_path / "load.json"
    path.write_text(json.dumps({"counts": [[5, 1, 2, 9], [3, 3, 0, 7]]}))
    return path


def _fails(argv, capsys, pattern: str) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and pattern in err, err
    assert "wrote" not in out


@pytest.mark.parametrize("raw", [b'{"counts":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                 b'{"counts":[[' + b"9" * 5000 + b",1,2,3]]}"], ids=["nested", "5000 digits"])
def test_load_file_json_the_parser_refuses_is_a_load_file_error(raw, tmp_path, capsys):
    path = tmp_path / "load.json"
    path.write_bytes(raw)
    _fails(["rebalance", "--load", str(path), *ARGS], capsys, "not JSON")


def test_out_or_plot_that_is_a_folder_is_refused_before_planning(load, tmp_path, capsys):
    _fails(["rebalance", "--load", str(load), *ARGS, "--out", str(tmp_path)], capsys, "is a folder")
    _fails(["rebalance", "--load", str(load), *ARGS, "--plot", str(tmp_path)], capsys, "is a folder")
    assert not tmp_path.with_suffix(".png").exists()


def test_out_that_cannot_be_written_is_a_typed_error(load, capsys, tmp_path, monkeypatch):
    import errno
    import io

    from fdeplb import input_files

    if Path("/dev/full").exists():  # a device: refused before the planning (it was written to: ENOSPC)
        assert main(["rebalance", "--load", str(load), *ARGS, "--out", "/dev/full"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --out /dev/full: ") and "a device, not a regular file" in err, err

    class Full(io.BytesIO):  # a regular file on a full disk: every write fails with ENOSPC
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(input_files, "open_output", lambda *args, **kwargs: Full())
    assert main(["rebalance", "--load", str(load), *ARGS, "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "cannot write" in err and "No space left on device" in err, err


def test_trtllm_placement_must_be_named_as_yaml_so_it_reads_back(load, tmp_path, capsys):
    _fails(["rebalance", "--load", str(load), *ARGS, "--format", "trtllm", "--out", str(tmp_path / "p.json")],
           capsys, ".yaml")
    assert not (tmp_path / "p.json").exists()
    out = tmp_path / "p.yaml"
    assert main(["rebalance", "--load", str(load), *ARGS, "--format", "trtllm", "--out", str(out)]) == 0
    assert read_placement(out, num_logical_experts=4, num_gpus=2).placement.phy2log.shape == (2, 8)


def test_a_yaml_file_with_aliases_is_refused_before_it_expands(tmp_path):
    """QA: a 600-byte TensorRT-LLM plan of nested aliases ("billion laughs": 10**12 numbers once read as a table)
    held `rearrange --plan`, `init-cluster --initial` and `rebalance --old/--load` at full CPU until memory ran out.
    YAML aliases are refused with one line naming the first; nothing is expanded."""
    from fdeplb.errors import LoadFileError, PlacementFileError
    from fdeplb.placement import read_expert_load, read_placement
    from tests.helpers import within

    lines = ["a0: &a0 [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 12)]
    plan, load = tmp_path / "bomb.yaml", tmp_path / "bomb_load.yaml"
    plan.write_text("\n".join(lines) + "\nphysical_to_logical_map: [*a11]\n")
    load.write_text("\n".join(lines) + "\nlogical_count: *a11\n")
    with pytest.raises(PlacementFileError, match="not YAML \\(aliases \\(\\*name\\) are refused.*line 2"):
        within(lambda: read_placement(plan), 30.0)
    with pytest.raises(LoadFileError, match="aliases \\(\\*name\\) are refused"):
        within(lambda: read_expert_load(load), 30.0)


@pytest.mark.parametrize("name,text", [
    ("dup.json", '{"logical_count": [[1, 2, 3, 4]], "logical_count": [[5, 6, 7, 8]]}'),
    ("dup.yaml", "logical_count: [[1, 2, 3, 4]]\nlogical_count: [[5, 6, 7, 8]]\n"),
])
def test_a_document_with_a_key_given_twice_is_refused(tmp_path, name, text):
    """QA: JSON's and YAML's parsers keep the last of two equal keys without a word (a TensorRT-LLM plan with two
    rows for one layer key lost one); a document that reads two ways is refused, naming the key."""
    from fdeplb.errors import LoadFileError
    from fdeplb.placement import read_expert_load

    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(LoadFileError, match="'logical_count' appears twice"):
        read_expert_load(path)
