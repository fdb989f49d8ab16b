"""Checkpoint reading, staging and verified in-place swaps on real paddle tensors and real safetensors files."""

from __future__ import annotations

import gc
import json
import weakref

import numpy as np
import pytest

pytest.importorskip("paddle")
pytest.importorskip("safetensors")

from fdeplb.errors import CheckpointError, InputError, StagingBudgetError, VerificationError, WeightError  # noqa: E402
from fdeplb.weights import (  # noqa: E402
    PRESETS,
    CheckpointReader,
    ExpertTemplate,
    LiveExperts,
    plan_transfer,
    routing_tables,
    stage_experts,
    write_synthetic_checkpoint,
)
from fdeplb.placement.digest import routing_digest  # noqa: E402
from tests.weights.helpers import EP, NEW, OLD, E, L, snapshot_bytes  # noqa: E402


def staged_round(ckpt, device: str = "cpu"):
    """Rank 0 loaded at OLD, its plan to NEW and that plan staged: ``(reader, live, plan, staged)``."""
    reader = CheckpointReader(ckpt)
    live = LiveExperts.from_checkpoint(reader, OLD, 0, EP, device=device)
    plan = plan_transfer(OLD, NEW, 0, EP)
    return reader, live, plan, stage_experts(plan, reader, device=device)


def pointers(live: LiveExperts) -> list[int]:
    ptrs = [t.data_ptr() for layers in live.tensors.values() for t in layers]
    return ptrs + [live.phy2log_tensor.data_ptr(), live.log2phy.data_ptr(), live.logcnt.data_ptr()]


def test_synthetic_checkpoint_layout(ckpt):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["ernie.layers.2.mlp.experts.7.up_gate_proj.weight"].endswith(".safetensors")
    assert index["ernie.layers.0.mlp.experts.0.down_proj.weight"] != index["ernie.layers.1.mlp.experts.7.down_proj.weight"]
    reader = CheckpointReader(ckpt)
    assert reader.spec == {"up_gate_proj.weight": ((16, 16), "float32"), "down_proj.weight": ((8, 16), "float32")}
    assert reader.expert_nbytes == (16 * 16 + 8 * 16) * 4
    a, b = reader.read_expert(1, 2), reader.read_expert(1, 2)
    assert all((a[s].numpy() == b[s].numpy()).all() for s in a)
    assert not (reader.read_expert(1, 3)["down_proj.weight"].numpy() == a["down_proj.weight"].numpy()).all()


def test_each_shard_opened_once(ckpt):
    reader = CheckpointReader(ckpt)
    for layer in range(L):
        for e in range(E):
            reader.read_expert(layer, e)
    assert reader.shards_opened == len({*json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"].values()})
    assert reader.tensors_read == L * E * 2


def test_load_swap_verify_in_place(ckpt):
    reader = CheckpointReader(ckpt)
    live = LiveExperts.from_checkpoint(reader, OLD, 0, EP, device="cpu")
    assert reader.tensors_read == L * 6 * 2  # rank 0 holds 6 distinct experts per layer, 2 tensors each
    assert live.verify(reader) == (L * 6, L * 6)
    assert live.tensors["up_gate_proj.weight"][0].shape == [6, 16, 16]
    ptrs = pointers(live)

    plan = plan_transfer(OLD, NEW, 0, EP)
    assert plan.counts == {"keep": 8, "local": 7, "disk": 2}  # 7 of layer 0 read once for two slots
    before = reader.tensors_read
    staged = stage_experts(plan, reader, device="cpu")
    assert reader.tensors_read - before == plan.counts["disk"] * 2  # only the plan's disk experts, each once
    assert staged.nbytes == plan.nbytes(reader.expert_nbytes)["disk"]

    report = live.swap(plan, staged, NEW)
    staged.release()
    assert pointers(live) == ptrs  # storage unchanged: captured graphs and references stay valid
    assert report.slots_verified == 10 and report.disk == 2 and report.local == 7 and report.disk_slots == 3
    assert report.bytes_from_staging == plan.disk_slots * reader.expert_nbytes
    assert (live.phy2log == NEW).all()
    log2phy, logcnt = routing_tables(NEW, E, live.max_replicas)
    assert (live.log2phy.numpy() == log2phy).all() and (live.logcnt.numpy() == logcnt).all()
    assert (live.phy2log_tensor.numpy() == NEW).all()
    assert live.verify(reader) == (L * 6, L * 6)


def test_corrupted_staged_tensor_fails_verification_and_reload_repairs(ckpt):
    reader, live, plan, staged = staged_round(ckpt)
    victim = staged.experts[0]["down_proj.weight"]
    victim[0, 0] = victim[0, 0] + 1.0  # one flipped value in host staging
    with pytest.raises(VerificationError, match="differ from the checkpoint"):
        live.swap(plan, staged, NEW)
    assert live.needs_reload and (live.phy2log == OLD).all()  # routing still the old placement
    with pytest.raises(WeightError):
        live.swap(plan, staged, NEW)
    live.reload(reader)
    assert not live.needs_reload and live.verify(reader) == (L * 6, L * 6)


def test_corrupted_live_slot_is_reported_by_verify(ckpt):
    reader = CheckpointReader(ckpt)
    live = LiveExperts.from_checkpoint(reader, OLD, 1, EP, device="cpu")
    t = live.tensors["up_gate_proj.weight"][2]
    t[4, 1, 1] = -t[4, 1, 1] + 0.5
    assert live.verify(reader) == (L * 6 - 1, L * 6)


def test_abort_leaves_live_bit_identical_and_frees_staging(ckpt):
    reader, live, plan, staged = staged_round(ckpt)
    before = snapshot_bytes(live)
    refs = [weakref.ref(t) for tensors in staged.experts for t in tensors.values()]
    staged.release()
    gc.collect()
    assert staged.nbytes == 0 and all(r() is None for r in refs)
    assert snapshot_bytes(live) == before
    with pytest.raises(WeightError, match="released"):
        live.swap(plan, staged, NEW)
    assert snapshot_bytes(live) == before


def test_budget_refusal_reads_nothing(ckpt):
    reader = CheckpointReader(ckpt)
    plan = plan_transfer(OLD, NEW, 0, EP)
    need = plan.nbytes(reader.expert_nbytes)["disk"]
    with pytest.raises(StagingBudgetError, match=f"needs {need} bytes"):
        stage_experts(plan, reader, budget_bytes=need - 1)
    assert reader.tensors_read == 0
    assert len(stage_experts(plan, reader, budget_bytes=need)) == plan.counts["disk"]


def test_swap_refuses_mismatched_inputs_before_writing(ckpt):
    reader, live, plan, staged = staged_round(ckpt)
    before = snapshot_bytes(live)
    other = plan_transfer(OLD, np.roll(NEW, 1, axis=1), 0, EP)
    with pytest.raises(WeightError, match="another plan"):
        live.swap(other, staged, np.roll(NEW, 1, axis=1))
    with pytest.raises(InputError, match="does not match"):
        live.swap(plan, staged, OLD)
    with pytest.raises(InputError, match="rank"):
        live.swap(plan_transfer(OLD, NEW, 1, EP), staged, NEW)
    assert snapshot_bytes(live) == before


def test_missing_tensor_fails_in_loading_naming_tensor_and_file(tmp_path):
    path = write_synthetic_checkpoint(tmp_path / "ck", 2, 4, skip=frozenset({(1, 3, "down_proj.weight")}))
    reader = CheckpointReader(path)
    old = np.array([[0, 1, 2, 3, 0, 1]] * 2)  # rank 0 of 2 holds experts 0, 1, 2
    new = np.array([[0, 1, 2, 3, 0, 1], [3, 1, 2, 0, 1, 2]])  # layer 1: rank 0 needs expert 3, whose tensor is missing
    live = LiveExperts.from_checkpoint(reader, old, 0, 2, device="cpu")
    before, read = snapshot_bytes(live), reader.tensors_read
    plan = plan_transfer(old, new, 0, 2)
    with pytest.raises(CheckpointError, match=r"ernie\.layers\.1\.mlp\.experts\.3\.down_proj\.weight.*index\.json"):
        stage_experts(plan, reader)
    assert reader.tensors_read == read and snapshot_bytes(live) == before
    # the index lists the tensor but the shard lacks it: the error names the shard
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["ernie.layers.1.mlp.experts.3.down_proj.weight"] = "model-00001-of-00002.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors"):
        stage_experts(plan, CheckpointReader(path))


def _rewrite_header(shard, name, lie):
    """Rewrite the safetensors header of ``shard``: tensor ``name``'s entry updated with ``lie(entry)``."""
    import struct

    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header[name].update(lie(header[name]))
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    shard.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


@pytest.mark.parametrize("lie", [
    lambda t: {"data_offsets": [str(x) for x in t["data_offsets"]]},    # offsets as strings
    lambda t: {"data_offsets": dict(zip("be", t["data_offsets"]))},     # offsets as an object
    lambda t: {"data_offsets": [x + 0.5 for x in t["data_offsets"]]},   # fractional offsets, right size
    lambda t: {"shape": [-t["shape"][0], *t["shape"][1:]],              # negative dim, reversed offsets:
               "data_offsets": t["data_offsets"][::-1]},                # the sizes agree
    lambda t: {"dtype": [t["dtype"]]},                                  # dtype not a string
], ids=["str-offsets", "object-offsets", "fractional-offsets", "negative-shape", "list-dtype"])
def test_lying_shard_header_met_while_staging_is_a_checkpoint_error(tmp_path, lie):
    """A shard first opened by staging (the live slots were loaded before it was rewritten) whose header lies
    about a needed expert: a CheckpointError naming the tensor and the file, never a bare TypeError / paddle error;
    nothing read, live slots unchanged."""
    path = write_synthetic_checkpoint(tmp_path / "ck", 2, 4)
    old = np.array([[0, 1, 2, 3, 0, 1]] * 2)
    new = np.array([[0, 1, 2, 3, 0, 1], [3, 1, 2, 0, 1, 2]])  # layer 1: rank 0 of 2 needs expert 3 from disk
    live = LiveExperts.from_checkpoint(CheckpointReader(path), old, 0, 2, device="cpu")
    before = snapshot_bytes(live)
    name = "ernie.layers.1.mlp.experts.3.down_proj.weight"
    shard = path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]
    _rewrite_header(shard, name, lie)
    with pytest.raises(CheckpointError, match=r"experts\.3\.down_proj.*safetensors"):
        stage_experts(plan_transfer(old, new, 0, 2), CheckpointReader(path))
    assert snapshot_bytes(live) == before


@pytest.mark.parametrize(
    "kwargs",
    [
        {"preset": "ernie-quant"},
        {"preset": "generic"},
        {"preset": "ernie", "dtype": "bfloat16", "single_file": True},
        {"template": PRESETS["ernie"].with_layers(first_layer=3)},
    ],
    ids=["ernie-quant", "generic", "bf16-single-file", "layer-offset"],
)
def test_checkpoint_flavours_load_and_swap(tmp_path, kwargs):
    path = write_synthetic_checkpoint(tmp_path / "ck", L, E, seed=11, **kwargs)
    reader = CheckpointReader(path, **{k: v for k, v in kwargs.items() if k in ("preset", "template")})
    live = LiveExperts.from_checkpoint(reader, OLD, 0, EP, device="cpu")
    assert set(live.tensors) == set(reader.template.suffixes)
    plan = plan_transfer(OLD, NEW, 0, EP)
    staged = stage_experts(plan, reader)
    live.swap(plan, staged, NEW)
    assert live.verify(reader) == (L * 6, L * 6)


def test_quantised_and_generic_names_and_dtypes(tmp_path):
    quant = CheckpointReader(write_synthetic_checkpoint(tmp_path / "q", 1, 2, preset="ernie-quant"), "ernie-quant")
    assert quant.spec["up_gate_proj.quant_weight"] == ((16, 16), "int8")
    assert quant.spec["down_proj.weight_scale"] == ((16,), "float32")
    generic = CheckpointReader(write_synthetic_checkpoint(tmp_path / "g", 1, 2, preset="generic"), "generic")
    assert generic.template.name(0, 1, "up_proj.weight") == "model.layers.0.mlp.experts.1.up_proj.weight"
    assert generic.spec["down_proj.weight"] == ((16, 8), "float32")
    offset = ExpertTemplate("model.layers.{layer}.mlp.experts.{expert}.{suffix}", ("w",), layer_ids=(1, 3, 5))
    assert offset.name(2, 0, "w") == "model.layers.5.mlp.experts.0.w"
    with pytest.raises(InputError):
        ExpertTemplate("layers.{layer}.{suffix}", ("w",))
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        CheckpointReader(tmp_path / "nowhere")


def test_repeated_rounds_stay_exact(ckpt):
    rng = np.random.default_rng(5)
    reader = CheckpointReader(ckpt)
    current = OLD.copy()
    live = LiveExperts.from_checkpoint(reader, current, 1, EP, device="cpu")
    for _ in range(4):
        target = np.stack([np.concatenate([rng.permutation(E), rng.integers(0, E, 4)]) for _ in range(L)])
        plan = plan_transfer(current, target, 1, EP)
        staged = stage_experts(plan, reader)
        live.swap(plan, staged, target)
        staged.release()
        current = target
    assert live.verify(reader) == (L * 6, L * 6)


def test_importing_weights_does_not_import_paddle_and_missing_paddle_is_a_dependency_error(monkeypatch):
    import subprocess
    import sys

    code = "import sys, fdeplb.weights; sys.exit('paddle' in sys.modules or 'safetensors' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0

    from fdeplb.errors import DependencyError
    from fdeplb.weights import _paddle

    monkeypatch.setitem(sys.modules, "paddle", None)  # what an uninstalled package looks like to import
    _paddle.paddle.cache_clear()
    _paddle.safetensors.cache_clear()
    try:
        with pytest.raises(DependencyError, match=r"fdeplb\[paddle\]"):
            _paddle.paddle()
    finally:
        monkeypatch.undo()
        _paddle.paddle.cache_clear()
        _paddle.safetensors.cache_clear()


@pytest.mark.real_data("dsv3_sglang_ep_stats/prefill_in1024.json")  # to decode_in1000out1000 (bundled)
@pytest.mark.slow  # runs benchmarks/swap.py
def test_swap_benchmark_smoke(real_data, monkeypatch):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "swap.py"
    spec = importlib.util.spec_from_file_location("swap_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "swap_benchmark", bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    bench.REAL_DATA = real_data / "dsv3_sglang_ep_stats"
    result = bench.main(["--scale", "128", "--repeats", "1"])
    assert result["slots_verified"] == result["slots_total"] == 58 * 9
    assert result["bytes_read_from_disk"] == result["counts"]["disk"] * result["expert_nbytes"]
    assert result["peak_staging_bytes"] == result["bytes_read_from_disk"]
    # the pause table's fields (figures, not targets: timings are the benchmark's to judge, never a test's)
    assert len(result["pause_ms_chunked"]) == result["chunks_per_swap"] >= 1
    assert result["copy_threads"] >= 1 and result["pause_vs_parallel_memcpy"] > 0
    assert set(result["pause_targets"]) == {"pause_vs_memcpy<=1.5", "max_chunked<=unchunked/8",
                                            "sum_chunked<=1.2*unchunked"}


def _gpu_device() -> str | None:
    import paddle

    if not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() < 1:
        return None
    return "gpu:0"


def test_gpu_swap_in_place(ckpt):
    device = _gpu_device()
    if device is None:
        pytest.skip("needs a CUDA build of paddle and a GPU")
    reader, live, plan, staged = staged_round(ckpt, device)
    assert live.tensors["down_proj.weight"][0].place.is_gpu_place()
    ptrs = pointers(live)
    assert all(t.place.is_cuda_pinned_place() for tensors in staged.experts for t in tensors.values())
    live.swap(plan, staged, NEW)
    staged.release()
    assert pointers(live) == ptrs
    assert live.verify(reader) == (L * 6, L * 6)


def test_attach_wraps_engine_tensors_and_refuses_wrong_ones(ckpt):
    reader = CheckpointReader(ckpt)
    loaded = LiveExperts.from_checkpoint(reader, OLD, 0, EP, device="cpu")
    attached = LiveExperts.attach(loaded.tensors, OLD, 0, EP, reader)  # e.g. the serving engine's own parameters
    plan = plan_transfer(OLD, NEW, 0, EP)
    attached.swap(plan, stage_experts(plan, reader), NEW)
    assert loaded.tensors["down_proj.weight"][0].data_ptr() == attached.tensors["down_proj.weight"][0].data_ptr()
    with pytest.raises(VerificationError, match="differ from the checkpoint"):
        LiveExperts.attach(loaded.tensors, OLD, 0, EP, reader)  # the tensors now hold NEW, not OLD


def test_attach_takes_the_engines_suffixes_in_any_order_and_names_a_wrong_one(ckpt):
    """An engine's dict of expert tensors in another key order than the checkpoint's (down before up, say, sorted)
    was refused as "10 of 10 live slots differ from the checkpoint": checksums were compared suffix by suffix in
    each side's own order. It attaches (the same tensor objects), swaps and serves its peers in the checkpoint's
    order; a missing or extra suffix, or a slot of another shape or dtype, is an InputError naming it."""
    import paddle

    from fdeplb.weights.backend import CheckpointBackend

    reader = CheckpointReader(ckpt)
    loaded = LiveExperts.from_checkpoint(reader, OLD, 0, EP, device="cpu")
    engine = dict(reversed(list(loaded.tensors.items())))
    assert list(engine) != list(reader.spec)
    attached = LiveExperts.attach(engine, OLD, 0, EP, reader)
    assert list(attached.tensors) == list(reader.spec)
    assert all(a is b for s in engine for a, b in zip(attached.tensors[s], engine[s]))
    plan = plan_transfer(OLD, NEW, 0, EP)
    attached.swap(plan, stage_experts(plan, reader), NEW)
    assert attached.verify(reader) == (L * 6, L * 6)
    served, _ = CheckpointBackend(attached, reader).serve_expert(0, int(NEW[0, 0]), routing_digest(NEW))
    assert [suffix for suffix, _ in served] == list(reader.spec)

    up, down = "up_gate_proj.weight", "down_proj.weight"
    with pytest.raises(InputError, match=f"suffixes \\['{up}'\\], the checkpoint's experts \\['{down}', '{up}'\\]"):
        LiveExperts.attach({up: engine[up]}, NEW, 0, EP, reader)
    with pytest.raises(InputError, match=f"live {down!r} slots are float16"):
        LiveExperts.attach({up: engine[up], down: [t.astype("float16") for t in engine[down]]}, NEW, 0, EP, reader)
    wide = [paddle.concat([t, t], axis=-1) for t in engine[down]]
    with pytest.raises(InputError, match=f"live {down!r} slots are float32.*, the checkpoint's float32"):
        LiveExperts.attach({up: engine[up], down: wide}, NEW, 0, EP, reader)


def test_swap_without_recorded_checksums_refuses_before_writing(ckpt):
    reader = CheckpointReader(ckpt)
    loaded = LiveExperts.from_checkpoint(reader, OLD, 0, EP, device="cpu")
    wrapped = LiveExperts(loaded.tensors, OLD, 0, EP, device="cpu")  # no verify(): checksums unknown
    before = snapshot_bytes(wrapped)
    plan = plan_transfer(OLD, NEW, 0, EP)
    with pytest.raises(VerificationError, match="no checkpoint checksum"):
        wrapped.swap(plan, stage_experts(plan, reader), NEW)
    assert snapshot_bytes(wrapped) == before and not wrapped.needs_reload


def test_released_staging_buffers_are_reused_by_the_next_staging(ckpt):
    reader, live, plan, staged = staged_round(ckpt)
    ids = {id(t) for tensors in staged.experts for t in tensors.values()}
    nbytes = staged.nbytes
    staged.release(keep_buffers=True)
    assert reader.pooled_bytes == nbytes and staged.nbytes == 0
    again = stage_experts(plan, reader)  # same plan: every buffer comes from the pool, contents read afresh
    assert {id(t) for tensors in again.experts for t in tensors.values()} == ids
    assert reader.pooled_bytes == 0
    live.swap(plan, again, NEW)  # verifies every changed slot against the checksums of the reused buffers
    reader.trim()
    assert reader.pooled_bytes == 0


def test_routing_over_live_ranks_names_no_slot_of_another_rank(ckpt):
    from fdeplb.errors import RedundancyError

    reader = CheckpointReader(ckpt)
    live = LiveExperts.from_checkpoint(reader, OLD, 1, 4, device="cpu")  # 4 ranks of 3 slots; rank 3: 1, 2, 3
    full = (live.log2phy.numpy().copy(), live.logcnt.numpy().copy())
    ptrs = pointers(live)
    live.set_live_ranks((0, 1, 2))
    log2phy, logcnt = live.log2phy.numpy(), live.logcnt.numpy()
    assert live.live_ranks == (0, 1, 2) and pointers(live) == ptrs  # rewritten in place
    assert not np.isin(log2phy, [9, 10, 11]).any() and (logcnt >= 1).all()
    assert logcnt[0].tolist() == [2, 1, 1, 1, 1, 1, 1, 1]  # 1, 2, 3 lost their replica on rank 3
    assert log2phy.shape == full[0].shape  # the fixed width stays: tables keep their shape
    # rank 0 as well: experts 1 and 2 would have no live replica: refused, tables unchanged
    with pytest.raises(RedundancyError, match="no replica on a live rank"):
        live.set_live_ranks((1, 2))
    assert (live.log2phy.numpy() == log2phy).all() and live.live_ranks == (0, 1, 2)
    with pytest.raises(InputError):
        live.set_live_ranks((0, 7))
    live.set_live_ranks((0, 1, 2, 3))  # every rank again: the full tables
    assert (live.log2phy.numpy() == full[0]).all() and (live.logcnt.numpy() == full[1]).all()


def test_a_fifo_in_place_of_a_shard_or_the_index_is_refused_not_waited_on(tmp_path):
    # QA: a shard was opened with a plain os.open(O_RDONLY), which blocks on a FIFO until a writer comes
    import os

    from tests.helpers import within

    path = write_synthetic_checkpoint(tmp_path / "ck", 2, 4)
    shard = sorted(path.glob("*.safetensors"))[0]
    shard.unlink()
    os.mkfifo(shard)
    reader = CheckpointReader(path)
    name = next(n for n, f in json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].items()
                if f == shard.name)
    with pytest.raises(CheckpointError, match="a FIFO, not a regular file"):
        within(lambda: reader._open(reader.tensor_file(name)), 30, fifo=shard)
    index = path / "model.safetensors.index.json"
    index.unlink()
    os.mkfifo(index)
    with pytest.raises(CheckpointError, match="no such checkpoint"):  # not an index: refused, never opened
        within(lambda: CheckpointReader(index), 30, fifo=index)
