"""Placement files (fdeplb, SGLang, TensorRT-LLM, FastDeploy) and the ``fdeplb rebalance`` command."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from fdeplb.cli import main
from fdeplb.errors import InputError, NotFoundError, PlacementFileError
from fdeplb.placement import (
    FORMATS,
    initial_placement,
    moved_experts,
    read_expert_load,
    read_placement,
    rebalance_experts,
    write_placement,
)

LOAD = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86], [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])


@pytest.fixture
def plan():
    return rebalance_experts(LOAD, 16, 4, 2, 8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_round_trips(tmp_path, plan, fmt):
    path = tmp_path / ("plan.yaml" if fmt == "trtllm" else "plan.json")
    write_placement(plan, path, format=fmt, layer_ids=[3, 4], load_digest="abc", expert_load=LOAD)
    back = read_placement(path, num_logical_experts=12, num_gpus=8, num_groups=4, num_nodes=2)
    assert back.format == fmt and back.placement == plan
    assert back.layer_ids.tolist() == ([3, 4] if fmt in ("fdeplb", "trtllm") else [0, 1])
    if fmt == "fdeplb":
        assert back.load_digest == "abc" and back.placement.policy == "deepseek"


def test_foreign_layouts_match_the_engines(tmp_path, plan):
    write_placement(plan, tmp_path / "s.json", format="sglang", layer_ids=[3, 4], num_model_layers=5)
    doc = json.loads((tmp_path / "s.json").read_text())
    assert list(doc) == ["physical_to_logical_map"]  # SGLang passes every key to init_by_mapping
    rows = doc["physical_to_logical_map"]
    assert len(rows) == 5 and rows[0] == [p % 12 for p in range(16)] and rows[3:] == plan.phy2log.tolist()
    back = read_placement(tmp_path / "s.json", num_gpus=8, num_groups=4, num_nodes=2)
    assert back.for_layers([3, 4]) == plan

    write_placement(plan, tmp_path / "t.yaml", format="trtllm", layer_ids=[3, 4])
    doc = yaml.safe_load((tmp_path / "t.yaml").read_text())
    assert doc["num_slots"] == 16 and doc["layer_updates_per_iter"] == 0
    assert doc["initial_global_assignments"] == {3: plan.phy2log[0].tolist(), 4: plan.phy2log[1].tolist()}

    write_placement(plan, tmp_path / "f.json", format="fastdeploy", expert_load=LOAD)
    doc = json.loads((tmp_path / "f.json").read_text())
    assert doc["ep_rank_to_expert_id_list"] == plan.phy2log.tolist()
    assert doc["expert_in_rank_num_list"] == plan.logcnt.tolist()
    assert doc["tokens_per_expert_stats_list"] == LOAD.tolist()
    assert np.array(doc["expert_id_to_ep_rank_array"]).shape == (2, 12, 5)  # num_redundant_experts + 1


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("p.json", None, "not found"),
        ("p.json", "{oops", "not JSON"),
        ("p.yaml", "a: [1, 2", "not YAML"),
        ("p.json", "[1]", "mapping"),
        ("p.json", '{"something": 1}', "unknown placement layout"),
        ("p.json", '{"physical_to_logical_map": [[0, 1], [0]]}', "ragged"),
        ("p.json", '{"physical_to_logical_map": [[0.5, 1]]}', "integer"),
        ("p.json", '{"physical_to_logical_map": [[true, 0]]}', "holds booleans"),  # not expert 1
        ("p.json", '{"physical_to_logical_map": [[18446744073709551616, 0]]}', "value 1.845e\\+19, out of range"),
        ("p.json", '{"physical_to_logical_map": [[0, 2]]}', "no slot"),
        ("p.json", '{"physical_to_logical_map": [[0, 1, 2]]}', "multiple of num_gpus"),
        ("p.yaml", "num_slots: 3\ninitial_global_assignments: {0: [0, 1]}\n", "num_slots"),
        ("p.yaml", "a: [1, 2\nb: 3\n", r"^[^\n]*not YAML \(while parsing[^\n]*line 1, column 4[^\n]*\)$"),  # one line
    ],
)
def test_bad_placement_files_raise_placement_file_error(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(PlacementFileError, match=message) as info:
        read_placement(path, num_gpus=2)
    assert str(path) in str(info.value)


def test_tampered_or_mismatched_fdeplb_file(tmp_path, plan):
    path = write_placement(plan, tmp_path / "p.json")
    doc = json.loads(path.read_text())
    doc["logcnt"][0][0] += 1
    path.write_text(json.dumps(doc))
    with pytest.raises(PlacementFileError, match="do not match"):
        read_placement(path)
    write_placement(plan, path)
    with pytest.raises(PlacementFileError, match="num_gpus is 8"):
        read_placement(path, num_gpus=4)
    with pytest.raises(PlacementFileError, match="no row for model layer"):
        read_placement(path).for_layers([0, 7])
    with pytest.raises(InputError, match="unknown placement file format"):
        write_placement(plan, path, format="csv")
    doc = json.loads(path.read_text())
    for version in (99, None, True):  # a version this fdeplb does not know is not guessed at
        path.write_text(json.dumps({**doc, "version": version}))
        with pytest.raises(PlacementFileError, match="version .*; this fdeplb reads version 1"):
            read_placement(path)
    path.write_text(json.dumps(doc))  # a plan cut to 12 of its 16 slots: named by its shape, not by a lost expert
    path.write_text(json.dumps({**doc, "phy2log": [row[:12] for row in doc["phy2log"]]}))
    with pytest.raises(PlacementFileError, match=r"rows of 12 slots \(shape \(2, 12\)\), 16 slots per layer"):
        read_placement(path)
    write_placement(plan, path, format="sglang")
    with pytest.raises(PlacementFileError, match=r"rows of 16 slots \(shape \(2, 16\)\), 20 slots per layer"):
        read_placement(path, num_physical_experts=20)
    with pytest.raises(InputError, match="layer_ids"):
        write_placement(plan, path, layer_ids=[1, 1])


# ---- CLI ----------------------------------------------------------------------------------------------------------
@pytest.mark.real_data("dsv3_sglang_ep_stats/prefill_in1024.json", "dsv3_sglang_ep_stats/prefill_in2048.json")
@pytest.mark.slow  # two CLI runs on DeepSeek-V3 dumps, a matplotlib plot
def test_cli_rebalance_table_output_and_plot(real_data, tmp_path, capsys):
    load = real_data / "dsv3_sglang_ep_stats" / "prefill_in1024.json"
    out, png = tmp_path / "new.json", tmp_path / "heat.png"
    rc = main(["rebalance", "--load", str(load), "--num-replicas", "288", "--num-groups", "8", "--num-nodes", "4",
               "--num-gpus", "32", "--policy", "balanced", "--out", str(out), "--format", "sglang", "--plot", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "before (trivial)" in text and "after (balanced)" in text and "moved experts" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = read_placement(out, num_gpus=32)
    assert written.placement.num_layers == 61  # SGLang rows cover every model layer
    dump = read_expert_load(load)
    new = written.for_layers(dump.layer_ids)
    assert new.phy2log.tolist() == rebalance_experts(dump.expert_load, 288, 8, 4, 32, policy="balanced").phy2log.tolist()

    # move_aware from the written placement onto another workload, output as TensorRT-LLM YAML
    other = real_data / "dsv3_sglang_ep_stats" / "prefill_in2048.json"
    yml = tmp_path / "next.yaml"
    rc = main(["rebalance", "--load", str(other), "--num-replicas", "288", "--num-groups", "8", "--num-nodes", "4",
               "--num-gpus", "32", "--policy", "move_aware", "--old", str(out), "--out", str(yml), "--format",
               "trtllm"])
    assert rc == 0
    assert "before (--old)" in capsys.readouterr().out
    moved = moved_experts(new, read_placement(yml, num_gpus=32).placement, 32)
    assert 0 < moved < moved_experts(new, rebalance_experts(read_expert_load(other).expert_load, 288, 8, 4, 32,
                                                            policy="balanced"), 32)


@pytest.mark.real_data("qwen2_57b_oeplb/counts57b.json")
def test_cli_errors_map_to_exit_codes(real_data, tmp_path, capsys):
    load = real_data / "qwen2_57b_oeplb" / "counts57b.json"
    assert main(["rebalance", "--load", str(tmp_path / "nope.json"), "--num-replicas", "72", "--num-gpus", "8"]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["rebalance", "--load", str(load), "--num-replicas", "70", "--num-gpus", "8"]) == 2
    assert "multiple of num_gpus" in capsys.readouterr().err
    old = write_placement(initial_placement(2, 64, 72, num_gpus=8), tmp_path / "old.json")
    assert main(["rebalance", "--load", str(load), "--num-replicas", "72", "--num-gpus", "8", "--old", str(old)]) == 2
    err = capsys.readouterr().err
    assert "has 2 layer rows (model layers 0-1)" in err and "cannot be matched layer by layer" in err, err


def test_a_gzip_dump_reads_as_its_json_and_a_bad_one_is_a_load_file_error(tmp_path, capsys):
    """``*.json.gz`` dumps (the one bundled in the package) read as their JSON; a file named .gz that is not gzip,
    or gzip of bytes that are not UTF-8, is a LoadFileError naming it (exit 2), as an unreadable JSON file is."""
    import gzip
    import importlib.resources

    from fdeplb.errors import LoadFileError
    from fdeplb.placement import read_expert_load

    rows = [[5, 0, 3, 9], [1, 1, 2, 8]]
    plain, packed = tmp_path / "load.json", tmp_path / "load.json.gz"
    plain.write_text(json.dumps({"logical_count": rows}))
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert np.array_equal(read_expert_load(packed).expert_load, read_expert_load(plain).expert_load)
    bundled = importlib.resources.files("fdeplb.data").joinpath("dsv3_decode_in1000out1000.json.gz")
    assert read_expert_load(bundled).expert_load.shape == (58, 256)
    code = main(["rebalance", "--load", str(bundled), "--num-replicas", "288", "--num-gpus", "32"])
    assert code == 0 and "balancedness" in capsys.readouterr().out
    (tmp_path / "fake.json.gz").write_text(json.dumps({"logical_count": rows}))
    (tmp_path / "latin.json.gz").write_bytes(gzip.compress(b'{"logical_count": [[1, 2]], "x": "\xff"}'))
    for name in ("fake.json.gz", "latin.json.gz"):
        with pytest.raises(LoadFileError, match=f"{name}: cannot read expert-load file"):
            read_expert_load(tmp_path / name)
    assert main(["rebalance", "--load", str(tmp_path / "fake.json.gz"), "--num-replicas", "8",
                 "--num-gpus", "2"]) == 2


def test_a_load_dump_with_both_keys_is_refused(tmp_path):
    """``logical_count`` (dense rows dropped) and ``counts`` (every row kept) mean different things: not guessed."""
    from fdeplb.errors import LoadFileError

    path = tmp_path / "load.json"
    path.write_text(json.dumps({"logical_count": [[1, 2]], "counts": [[3, 4]]}))
    with pytest.raises(LoadFileError, match="both 'logical_count' and 'counts'"):
        read_expert_load(path)


@pytest.mark.parametrize("value, words", [("true", "holds booleans"), ("18446744073709551616", "1.845e+19, out of range"),
                                          ("9007199254740993", "above 2**53")])
def test_a_load_value_that_is_no_count_is_named_for_what_it_is(tmp_path, value, words):
    """A boolean, or a value past 64 bits (numpy would hold it as an object), is named as such, not as ragged rows."""
    from fdeplb.errors import LoadFileError

    path = tmp_path / "load.json"
    path.write_text('{"logical_count": [[3, 1], [%s, 2]]}' % value)
    with pytest.raises(LoadFileError) as info:
        read_expert_load(path)
    assert words in str(info.value) and "equally long rows" not in str(info.value)


@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
def test_an_input_that_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    """Every file read by path (load dump, placement or plan, recording, credentials file) must be a regular file:
    a FIFO (opening it for reading would wait for a writer forever), a device (/dev/null, /dev/zero never ends)
    or a folder is refused with the reader's typed error naming it, without blocking."""
    from fdeplb.credentials import load_credentials
    from fdeplb.errors import LoadFileError
    from fdeplb.replay import read_export
    from tests.helpers import within

    path = {"fifo": tmp_path / "fifo", "device": Path(os.devnull), "folder": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    words = {"fifo": "is a FIFO", "device": "is a device", "folder": "is a folder"}[kind]
    for read, error in ((read_expert_load, LoadFileError), (read_placement, PlacementFileError),
                        (lambda p: list(read_export(p)), InputError), (load_credentials, InputError)):
        with pytest.raises(error, match=f"{path}: .*{words}, not a regular file"):
            within(lambda: read(path), fifo=path if kind == "fifo" else None)


def test_cli_inputs_that_are_fifos_exit_2_at_once(tmp_path, capsys, redis_url, cluster_id):
    """``rebalance --load FIFO`` and ``init-cluster --initial FIFO``: exit 2 naming the FIFO, nothing created."""
    from fdeplb.store import Store
    from tests.helpers import run_cli, within

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code, out, err = within(lambda: run_cli(capsys, "rebalance", "--load", str(fifo), "--num-replicas", "8",
                                            "--num-gpus", "2"), fifo=fifo)
    assert code == 2 and out == "" and f"{fifo}: expert-load file is a FIFO" in err
    code, out, err = within(lambda: run_cli(capsys, "init-cluster", "--redis-url", redis_url, "--cluster", cluster_id,
                                            "--num-layers", "1", "--num-logical-experts", "4",
                                            "--num-redundant-experts", "0", "--ep-size", "2", "--checkpoint",
                                            str(tmp_path), "--initial", str(fifo)), fifo=fifo)
    assert code == 2 and f"{fifo}: placement file is a FIFO" in err
    with pytest.raises(NotFoundError):
        Store(redis_url, cluster_id).read_config()


def test_an_input_over_the_size_cap_is_refused_before_it_is_read(tmp_path, capsys, monkeypatch):
    """A dump larger than MAX_INPUT_BYTES (a sparse file: nothing is written) is refused with one line, exit 2,
    from its size alone; a .gz one that decompresses past the cap too."""
    import gzip

    from fdeplb import input_files
    from fdeplb.errors import LoadFileError
    from tests.helpers import run_cli

    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(input_files.MAX_INPUT_BYTES + 1)
    with pytest.raises(LoadFileError, match=f"{big}: expert-load file holds {input_files.MAX_INPUT_BYTES + 1} bytes, "
                                            f"more than the {input_files.MAX_INPUT_BYTES}"):
        read_expert_load(big)
    code, out, err = run_cli(capsys, "rebalance", "--load", str(big), "--num-replicas", "8", "--num-gpus", "2")
    assert code == 2 and out == "" and err.count("\n") == 1 and "more than the" in err
    packed = tmp_path / "load.json.gz"
    packed.write_bytes(gzip.compress(json.dumps({"logical_count": [[1] * 400]}).encode()))
    assert read_expert_load(packed).expert_load.shape == (1, 400)
    monkeypatch.setattr(input_files, "MAX_INPUT_BYTES", 1000)  # the file is smaller, its JSON is not
    assert packed.stat().st_size < 1000
    with pytest.raises(LoadFileError, match="more than the 1000 bytes an input may hold once decompressed"):
        read_expert_load(packed)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_placement_named_gz_is_written_gzip_and_reads_back(tmp_path, plan, fmt):
    """The writer follows the reader's rule: ``*.gz`` is gzip (mtime 0: the same plan, the same bytes)."""
    path = tmp_path / ("plan.yaml.gz" if fmt == "trtllm" else "plan.json.gz")
    write_placement(plan, path, format=fmt, layer_ids=[3, 4])
    first = path.read_bytes()
    assert first[:2] == b"\x1f\x8b"  # gzip's magic
    assert read_placement(path, num_logical_experts=12, num_gpus=8, num_groups=4, num_nodes=2).placement == plan
    if fmt != "fastdeploy":  # FastDeploy's dump carries a timestamp
        write_placement(plan, path, format=fmt, layer_ids=[3, 4])
        assert path.read_bytes() == first


@pytest.mark.parametrize("fmt, name", [("trtllm", "p.json"), ("trtllm", "p.json.gz"), ("fdeplb", "p.yaml"),
                                       ("sglang", "p.yml.gz"), ("fastdeploy", "p.yaml")])
def test_a_placement_whose_name_says_another_kind_is_not_written(tmp_path, plan, fmt, name):
    """A trtllm placement is YAML and must be named so; a JSON one named *.yaml would read back as YAML: refused."""
    with pytest.raises(InputError, match=f"an? {fmt} placement is {'YAML' if fmt == 'trtllm' else 'JSON'}"):
        write_placement(plan, tmp_path / name, format=fmt)
    assert not (tmp_path / name).exists()
