"""The device-side load window (issue 31, item 1): counts recorded as paddle tensors stay on their device and the
window they make is exactly the int64 window the numpy path makes of the same steps, refusals included. No Redis:
the recorder runs on its own (a LoadRecorder with a window and a live phy2log, as a started agent has)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fdeplb.errors import InputError
from fdeplb.orchestration.device_window import BLOCK_STEPS
from fdeplb.orchestration.load_window import ExpertLoadWindow, LoadRecorder

paddle = pytest.importorskip("paddle")

INT64_MAX = int(np.iinfo(np.int64).max)
DTYPES = ["int32", "int64", "uint8", "int16", "int8"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def recorder(shape: tuple[int, int], phy2log: np.ndarray, steps: int | None, seconds: float | None,
             clock: Clock) -> LoadRecorder:
    """A recorder as a started agent holds it: a window of ``shape`` and the live phy2log."""
    rec = LoadRecorder()
    rec._init_load(None, steps, seconds, None)
    rec.window = ExpertLoadWindow(*shape, steps=steps, seconds=seconds, clock=clock)
    rec._live_phy2log = phy2log
    return rec


def counts(rng: np.random.Generator, dtype: str, shape: tuple[int, int], top: int, bad: bool = False) -> np.ndarray:
    """Counts of ``dtype`` up to ``top`` (the dtype's max for narrow ones); ``bad``: some may be negative."""
    top = min(top, int(np.iinfo(dtype).max))
    arr = rng.integers(0, top, shape, dtype=np.int64, endpoint=True)
    if rng.random() < 0.3:  # many at the top: int32 sums past 2**31, int64 sums near the range's end
        arr = np.where(rng.random(shape) < 0.5, top, arr)
    if bad and rng.random() < 0.2 and np.iinfo(dtype).min < 0:
        arr[tuple(rng.integers(0, s) for s in shape)] = -int(rng.integers(1, 100))
    return arr.astype(dtype)


class Engine:
    """Feeds the same steps to a numpy recorder and a device one; the device side reuses one tensor per kind, as
    an engine's router does (the window must have copied what it keeps)."""

    def __init__(self, L: int, E: int, P: int, steps: int | None, seconds: float | None, rng) -> None:
        self.clock, self.rng, self.E, self.P = Clock(), rng, E, P
        self.phy2log = self.placement(L)
        self.host = recorder((L, E), self.phy2log, steps, seconds, self.clock)
        self.device = recorder((L, E), self.phy2log, steps, seconds, self.clock)
        self.buffers: dict[tuple, object] = {}

    def placement(self, L: int) -> np.ndarray:
        p2l = np.tile(np.arange(self.P) % self.E, (L, 1))  # every logical expert has a slot
        return np.array([self.rng.permutation(row) for row in p2l], np.int64)

    def switch(self) -> None:
        """A placement change between two steps (at a safe point: the live phy2log is replaced)."""
        self.phy2log = self.placement(self.phy2log.shape[0])
        self.host._live_phy2log = self.device._live_phy2log = self.phy2log

    def tensor(self, arr: np.ndarray):
        key = (arr.shape, str(arr.dtype))
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = paddle.to_tensor(arr)
        else:
            buf.copy_(paddle.to_tensor(arr), False)
        return buf

    def step(self, arr: np.ndarray, physical: bool | None) -> tuple[str | None, str | None]:
        """Record ``arr`` on both; the device window is read at once (its checks run when it is read). Returns
        each side's refusal message (None: recorded)."""
        host_err = device_err = None
        try:
            self.host.record(arr, physical=physical)
        except InputError as err:
            host_err = str(err)
        self.device.record(self.tensor(arr), physical=physical)
        try:
            self.device.window.total()
        except InputError as err:
            device_err = str(err)
        return host_err, device_err

    def same(self) -> None:
        assert np.array_equal(self.device.window.total(), self.host.window.total())
        assert len(self.device.window) == len(self.host.window)


limits = st.one_of(
    st.tuples(st.integers(1, 2 * BLOCK_STEPS + 8), st.none()),
    st.tuples(st.none(), st.floats(0.5, 20)),
    st.tuples(st.integers(1, 2 * BLOCK_STEPS + 8), st.floats(0.5, 20)),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(L=st.integers(1, 3), E=st.integers(1, 5), extra=st.integers(0, 3), limit=limits,
       n=st.integers(1, 3 * BLOCK_STEPS), dtypes=st.lists(st.sampled_from(DTYPES), min_size=1, max_size=3),
       wide=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_device_window_equals_the_numpy_window_on_the_same_steps(L, E, extra, limit, n, dtypes, wide, seed):
    """Per-slot and logical counts of every integer dtype, int32 counts that sum past 2**31, int64 counts (summed
    by halves), placement changes mid-window, the step limit (whole blocks of steps reused across reads) and the
    time limit: the device window's total is the numpy window's, read at any point."""
    rng = np.random.default_rng(seed)
    P = E + extra
    steps, seconds = limit
    eng = Engine(L, E, P, steps, seconds, rng)
    # int64 counts below the range even summed over the whole run per logical expert: nothing is refused here
    top64 = (INT64_MAX // (n * P)) if wide else 2**31
    reads = set(rng.choice(n, size=min(n, 6), replace=False).tolist())
    for k in range(n):
        eng.clock.now += float(rng.exponential(1.0))
        if rng.random() < 0.05:
            eng.switch()
        dtype = dtypes[k % len(dtypes)]
        physical = bool(rng.random() < 0.6)
        shape = (L, P) if physical else (L, E)
        eng.host.record(arr := counts(rng, dtype, shape, top64 if dtype == "int64" else 2**31 - 1),
                        physical=physical)
        eng.device.record(eng.tensor(arr), physical=physical)
        if k in reads:
            eng.same()
    eng.same()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(L=st.integers(1, 2), E=st.integers(1, 3), extra=st.integers(0, 2), limit=limits,
       n=st.integers(1, 24), seed=st.integers(0, 2**32 - 1))
def test_a_device_window_read_every_step_refuses_what_record_refuses(L, E, extra, limit, n, seed):
    """Negative counts and counts near the int64 range: a device window read after every step refuses the same
    steps with the same messages as the numpy path's record(), and keeps the same window, but for one thing: a
    device step counts toward the step limit from when it is recorded (its values are known only when the window
    is read), so a refused one has pushed the oldest step out; the windows agree again once as many steps have
    been taken since as were refused (each fills the place of one)."""
    rng = np.random.default_rng(seed)
    P = E + extra
    eng = Engine(L, E, P, *limit, rng)
    owed = 0  # steps refused and not yet made up for by a step taken
    for _ in range(n):
        eng.clock.now += float(rng.exponential(2.0))
        if rng.random() < 0.1:
            eng.switch()
        physical = bool(rng.random() < 0.5)
        dtype = str(rng.choice(["int64", "int64", "int32", "int8"]))
        top = int(rng.choice([INT64_MAX // 2, INT64_MAX // 3, INT64_MAX, 1000]))
        host_err, device_err = eng.step(counts(rng, dtype, (L, P) if physical else (L, E), top, bad=True),
                                        physical)
        assert device_err == host_err
        owed = owed + 1 if host_err else max(0, owed - 1)
        eng.host.window.total()  # expires its old steps (a refused record() did not reach the window)
        assert len(eng.host.window) - owed <= len(eng.device.window) <= len(eng.host.window)
        if not owed:
            eng.same()


def _started(L=2, E=4, P=6, steps=8) -> LoadRecorder:
    return recorder((L, E), np.tile(np.arange(P) % E, (L, 1)).astype(np.int64), steps, None, Clock())


@pytest.mark.parametrize("dtype", ["float32", "float64", "bool", "float16"])
def test_a_device_tensor_of_a_wrong_dtype_is_refused_at_record_and_nothing_recorded(dtype):
    rec = _started()
    rec.record(paddle.ones([2, 6], dtype="int32"))
    before = rec.window.total()
    for _ in range(2):  # refused every time, not only the first
        with pytest.raises(InputError, match=f"must be an integer array, got dtype {dtype}"):
            rec.record(paddle.ones([2, 6], dtype=dtype))
    assert len(rec.window) == 1 and np.array_equal(rec.window.total(), before)


@pytest.mark.parametrize("shape, physical", [([2, 5], None), ([3, 6], None), ([6], None), ([2, 4], True)])
def test_a_device_tensor_of_a_wrong_shape_is_refused_with_the_numpy_paths_message(shape, physical):
    rec = _started()
    with pytest.raises(InputError) as device:
        rec.record(paddle.ones(shape, dtype="int32"), physical=physical)
    with pytest.raises(InputError) as host:
        rec.record(np.ones(shape, np.int32), physical=physical)
    assert str(device.value) == str(host.value) and len(rec.window) == 0


@pytest.mark.parametrize("top, words", [(2**70, "expert count 1180591620717411303424 is past the int64 range"),
                                        (-2**70, "must be >= 0, found -1180591620717411303424")])
def test_a_list_of_counts_past_int64_is_refused_as_such_not_as_a_non_integer(top, words):
    """Python ints numpy cannot hold make an object array: refused before as "must be an integer array, got
    dtype object" (they are integers), now with record()'s range messages."""
    rec = _started()
    with pytest.raises(InputError, match=words):
        rec.record([[top] + [1] * 5, [1] * 6])
    with pytest.raises(InputError, match="must be an integer array, got dtype object"):
        rec.record([[None] + [1] * 5, [1] * 6])
    assert len(rec.window) == 0


def test_a_refused_device_step_is_dropped_and_the_window_publishes_again():
    """The window with a negative step is not given out (the publication fails with record()'s message); that
    step is dropped, the others kept, and the next read gives the window of the good steps."""
    rec = _started()
    rec.record(paddle.full([2, 6], 3, dtype="int32"))
    rec.record(paddle.to_tensor(np.array([[1, -7, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], np.int32)))
    rec.record(paddle.full([2, 4], 2, dtype="int64"))
    with pytest.raises(InputError, match="must be >= 0, found -7"):
        rec.window.total()
    assert len(rec.window) == 2
    assert rec.window.total().tolist() == [[3 * 2 + 2, 3 * 2 + 2, 3 + 2, 3 + 2]] * 2


def test_record_of_a_device_tensor_reads_nothing_back(monkeypatch):
    """record() only queues device work: every way of reading a tensor to the host raises while it runs."""
    rec = _started(steps=BLOCK_STEPS + 3)
    engine_counts = paddle.ones([2, 6], dtype="int32")
    rec.record(engine_counts)  # its kind checked once

    def read(*_a, **_k):
        raise AssertionError("a host read in record()")

    with monkeypatch.context() as m:
        for name in ("numpy", "item", "tolist", "__array__", "__int__", "__float__", "__bool__", "__index__"):
            if hasattr(paddle.Tensor, name):
                m.setattr(paddle.Tensor, name, read)
        for _ in range(2 * BLOCK_STEPS):
            rec.record(engine_counts)
    assert (rec.window.total() == np.array([[2, 2, 1, 1]] * 2) * (BLOCK_STEPS + 3)).all()


def test_clear_empties_a_window_with_device_steps():
    rec = _started()
    for _ in range(3):
        rec.record(paddle.ones([2, 6], dtype="int32"))
    rec.record(np.ones((2, 4), np.int64))
    rec.window.clear()
    assert len(rec.window) == 0 and not rec.window.total().any()
    rec.record(paddle.ones([2, 4], dtype="int64"))
    assert rec.window.total().tolist() == [[1, 1, 1, 1]] * 2


def test_a_torch_tensor_is_taken_through_dlpack():
    torch = pytest.importorskip("torch")
    rec = _started()
    rec.record(torch.ones((2, 6), dtype=torch.int32))
    assert rec.window.total().tolist() == [[2, 2, 1, 1]] * 2


def test_record_benchmark_smoke(monkeypatch):
    """benchmarks/record.py on a tiny shape: its JSON fields, the windows equal and no host read per step (what
    the benchmark measures, not how fast: timings are the benchmark's to judge, never a test's)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "record.py"
    spec = importlib.util.spec_from_file_location("record_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script trims sys.path as it loads
    spec.loader.exec_module(bench)
    result = bench.main(["--layers", "3", "--physical", "8", "--logical", "6", "--steps", "150", "--window", "70",
                         "--device", "cpu"])
    assert result["benchmark"] == "record" and result["steps"] == 150 and result["window_steps"] == 70
    assert result["window_exact"] is True and result["host_reads_per_step"] == 0
    assert result["record_us"] > 0 and result["add_us"] > 0 and result["record_us_numpy"] > 0
    assert result["record_vs_add"] == pytest.approx(result["record_us"] / result["add_us"], rel=0.01)
    assert result["publish_us"] > 0 and result["publish_again_us"] > 0
    assert result["step_slowdown"] is None and result["step_slowdown_skipped"]  # a CPU run
    assert set(result["targets"]) == {"record_vs_add<=", "host_reads_per_step==", "window_exact", "step_slowdown<="}
    # the CUDA branch's step loop, run here on the CPU at a tiny size: it runs and gives a ratio (its figure is a GPU's)
    small = bench.parser().parse_args(["--layers", "2", "--physical", "8", "--logical", "6", "--steps", "8"])
    assert bench.step_slowdown(paddle, small, _started(P=8, E=6)._live_phy2log, tokens=16, hidden=32,
                               repeats=1) > 0
    original = paddle.Tensor.numpy
    with bench.counted_host_reads(paddle) as reads:  # the counter sees a read: the old path reads every step
        rec = _started()
        rec.window.add(bench.fold_counts(paddle.ones([2, 6], dtype="int32"), rec._live_phy2log, 4))
    assert reads["n"] == 1 and paddle.Tensor.numpy is original  # and the methods are given back
