"""Counts recorded on two devices (QA of the serving hot path, item 1): a step's device is part of its kind, so a
step is copied on its own device and the window sums each device's steps there, one read per device.

What this can check without a GPU (none is lent here): paddle has only the CPU, so the second device is a label
(:class:`FakeDevice`) this test gives some CPU tensors through ``count_device``, the one place the recorder asks a
tensor's device. Checked: each device's steps go into copies of that device only, no sum takes steps of two
devices, each device is read once per publication, the total is exact (the host path's), the refusals are the host
path's, and a warning says a second device came. Not checked: the real cost of a cross-device copy, nor paddle's
behaviour on two real devices (``benchmarks/record.py``'s CUDA branch on a GPU machine)."""

from __future__ import annotations

import numpy as np
import pytest
from structlog.testing import capture_logs

from fdeplb.errors import InputError
from fdeplb.orchestration import device_window, load_window
from fdeplb.orchestration.device_window import BLOCK_STEPS, StepCopies
from fdeplb.orchestration.load_window import ExpertLoadWindow, LoadRecorder

paddle = pytest.importorskip("paddle")

L, E, P = 2, 4, 6
PHY2LOG = np.tile(np.arange(P) % E, (L, 1)).astype(np.int64)


class FakeDevice:
    """A device label: hashable, equal to itself only (as paddle's Place is per device)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"FakeDevice({self.name})"


GPU = FakeDevice("gpu:0")


@pytest.fixture
def devices(monkeypatch):
    """A maker of tensors "on" :data:`GPU` (CPU tensors the recorder is told are there), and spies: each copy's
    source is on the copies' device, each partial sum takes one device's steps, and the reads per publication are
    counted."""
    on_gpu: dict[int, object] = {}

    real = load_window.count_device

    def device_of(t):
        return GPU if id(t) in on_gpu else real(t)

    copy, partial, read = StepCopies.copy, device_window._partial, device_window._read
    reads: list[int] = []

    def spy_copy(self, t):
        assert device_of(t) == self.device, f"a step on {device_of(t)} copied into copies on {self.device}"
        return copy(self, t)

    def spy_partial(steps, *a):
        assert len({s.device for s in steps}) == 1, "one sum took steps of two devices"
        return partial(steps, *a)

    def spy_read(t):
        reads.append(1)
        return read(t)

    monkeypatch.setattr(load_window, "count_device", device_of)
    monkeypatch.setattr(StepCopies, "copy", spy_copy)
    monkeypatch.setattr(device_window, "_partial", spy_partial)
    monkeypatch.setattr(device_window, "_read", spy_read)

    def gpu_tensor(arr: np.ndarray):
        t = paddle.to_tensor(arr)
        on_gpu[id(t)] = t
        return t

    return gpu_tensor, reads


def _recorder(steps: int) -> tuple[LoadRecorder, LoadRecorder]:
    """(device recorder, host recorder) with the same window and live phy2log."""
    pair = []
    for _ in range(2):
        rec = LoadRecorder()
        rec._init_load(None, steps, None, None)
        rec.window = ExpertLoadWindow(L, E, steps=steps)
        rec._live_phy2log = PHY2LOG
        pair.append(rec)
    return pair[0], pair[1]


def test_a_warm_up_step_on_the_cpu_then_gpu_steps_are_kept_and_summed_apart(devices):
    """The QA case: the first step's counts on the CPU, the rest on the GPU. Each device keeps its own copies
    and sums; one read per device per publication; the window equals the host path's, also once the CPU step
    has left the window (then one read)."""
    gpu_tensor, reads = devices
    rng = np.random.default_rng(7)
    rec, host = _recorder(steps=BLOCK_STEPS + 5)
    engine_gpu = gpu_tensor(np.zeros((L, P), np.int32))  # the engine's own tensor, rewritten every step
    with capture_logs() as logs:
        for i in range(BLOCK_STEPS + 5):
            arr = rng.integers(0, 1000, (L, P)).astype(np.int32)
            if i == 0:
                rec.record(paddle.to_tensor(arr))  # the warm-up step, on the CPU
            else:
                engine_gpu.copy_(paddle.to_tensor(arr), False)
                rec.record(engine_gpu)
            host.record(arr)
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1 and "another device" in warnings[0]["event"], logs
    assert np.array_equal(rec.window.total(), host.window.total())
    assert len(reads) == 2  # the CPU's read and the GPU's, nothing copied across

    arr = rng.integers(0, 1000, (L, P)).astype(np.int32)  # one more: the CPU step leaves the window
    engine_gpu.copy_(paddle.to_tensor(arr), False)
    rec.record(engine_gpu)
    host.record(arr)
    reads.clear()
    assert np.array_equal(rec.window.total(), host.window.total())
    assert len(reads) == 1


def test_steps_on_two_devices_interleaved_are_exact_and_refused_as_on_the_host(devices):
    """Steps alternating between devices (several dtypes, logical and per-slot): the same total as the host
    path; a negative count on the GPU is refused with record()'s message and dropped, the CPU's steps kept."""
    gpu_tensor, reads = devices
    rng = np.random.default_rng(11)
    rec, host = _recorder(steps=40)
    for i in range(30):
        shape, dtype = [((L, P), "int32"), ((L, E), "int64"), ((L, P), "uint8")][i % 3]
        arr = rng.integers(0, 200, shape).astype(dtype)
        rec.record(gpu_tensor(arr) if i % 2 else paddle.to_tensor(arr))
        host.record(arr)
    assert np.array_equal(rec.window.total(), host.window.total())
    bad = np.ones((L, P), np.int32)
    bad[1, 2] = -5
    rec.record(gpu_tensor(bad))
    with pytest.raises(InputError, match="must be >= 0, found -5"):
        rec.window.total()
    assert np.array_equal(rec.window.total(), host.window.total())


def test_a_window_past_int64_over_two_devices_is_refused_as_on_the_host(devices):
    """int64 counts near the range's end on two devices: the step that would take the sum past int64 is refused
    with the host path's message (replayed on the host: the rare path), the rest kept."""
    gpu_tensor, _ = devices
    rec, host = _recorder(steps=8)
    big = np.full((L, E), np.iinfo(np.int64).max // 2, np.int64)
    rec.record(paddle.to_tensor(big))
    rec.record(gpu_tensor(big))
    host.record(big)
    host.record(big)
    rec.record(gpu_tensor(big))
    with pytest.raises(InputError) as host_err:
        host.record(big)
    with pytest.raises(InputError) as device_err:
        rec.window.total()
    assert str(device_err.value) == str(host_err.value)
    assert np.array_equal(rec.window.total(), host.window.total())
