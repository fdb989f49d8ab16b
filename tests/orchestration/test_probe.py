"""The output probe's rules (fdeplb.orchestration.probe): what a probe may return, the tolerance, a probe that
raises or changes its outputs' shape, the reference a rank keeps after a failed probe; and a threaded cluster whose
probe raises on one rank after the swap: audited as a failed probe, the agent loop goes on, the round is rolled
back and the probe agrees again."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from fdeplb.errors import InputError
from fdeplb.rounds import reasons
from fdeplb.orchestration.probe import Probe, ProbeOutcome, ProbeRun, compare, outputs_of
from tests.helpers import thread_cluster, wait_for
from tests.orchestration.helpers import probed_cluster, round_done


def _run(before, after, reference=None, **tol):
    """A ProbeRun whose probe returns ``before`` then ``after`` (an exception instance is raised)."""
    values = iter([before, after])

    def fn():
        value = next(values)
        if isinstance(value, Exception):
            raise value
        return value

    run = ProbeRun(Probe(fn, **tol), reference)
    run.before()
    run.after()
    return run


# ---- what a probe returns ------------------------------------------------------------------------------------------
def test_outputs_of_takes_a_dict_or_a_list_and_copies():
    arr = np.arange(4.0)
    out = outputs_of({3: arr, 0: [1, 2]})
    assert sorted(out) == [0, 3] and out[3] is not arr and np.array_equal(out[3], arr)
    assert list(outputs_of([arr, arr])) == [0, 1]


@pytest.mark.parametrize("value, words", [
    (np.zeros(3), "one output per MoE layer"), ({}, "no layer"), ({-1: [1.0]}, "int >= 0"),
    ({"a": [1.0]}, "int >= 0"), ({True: [1.0]}, "int >= 0"), ({0: ["x"]}, "not numeric"), ("ab", "one output"),
])
def test_outputs_of_refuses_what_is_not_per_layer_numbers(value, words):
    with pytest.raises(InputError, match=words):
        outputs_of(value)


@pytest.mark.parametrize("kw", [dict(rtol=-1.0), dict(atol=float("nan")), dict(rtol=True), dict(atol="0")])
def test_a_bad_tolerance_or_fn_is_an_input_error(kw):
    with pytest.raises(InputError, match="probe"):
        Probe(lambda: {0: [1.0]}, **kw)
    with pytest.raises(InputError, match="callable"):
        Probe(42)


# ---- the tolerance -------------------------------------------------------------------------------------------------
def test_bit_exact_by_default_and_within_the_engines_tolerance():
    ref = {0: np.array([1.0, 2.0], np.float32), 1: np.array([3.0], np.float32)}
    nudged = {0: np.nextafter(ref[0], np.float32(9)), 1: ref[1].copy()}
    bad = compare(ref, nudged)
    assert [m.layer for m in bad] == [0] and "2 of 2 values differ" in bad[0].message
    assert compare(ref, nudged, rtol=1e-6) == []
    assert compare(ref, nudged, atol=1e-6) == []
    assert [m.layer for m in compare(ref, {0: ref[0] + 1e-3, 1: ref[1]}, rtol=1e-6, atol=1e-6)] == [0]


@pytest.mark.parametrize("before, after, words", [
    ([np.nan, np.nan], [np.nan, np.nan], "2 of 2 values NaN after the swap, 2 before"),  # all-NaN checks nothing
    ([1.0, np.nan], [1.0, np.nan], "1 of 2 values NaN after the swap, 1 before"),
    ([1.0, 2.0], [1.0, np.nan], "1 of 2 values NaN after the swap, 0 before"),
    ([np.nan, 2.0], [1.0, 2.0], "0 of 2 values NaN after the swap, 1 before"),
    ([1.0, 2.0], [complex(1, np.nan), 2.0], "1 of 2 values NaN after the swap, 0 before"),
])
def test_a_nan_output_is_never_agreement(before, after, words):
    dtype = np.complex64 if any(isinstance(v, complex) for v in after) else np.float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy All-NaN / invalid-value warning on the way
        bad = compare({0: np.array(before, dtype)}, {0: np.array(after, dtype)}, rtol=1e-3, atol=1e-3)
        run = _run({0: np.array(before, dtype)}, {0: np.array(after, dtype)})
    assert [m.layer for m in bad] == [0] and words in bad[0].message and "never agrees" in bad[0].message
    assert run.result.outcome is ProbeOutcome.MISMATCH and run.result.layers == (0,) and words in run.result.message


def test_infinities_agree_only_with_the_same_infinity_and_say_so_without_a_warning():
    ref = {0: np.array([np.inf, -np.inf, 1.0])}
    assert compare(ref, {0: ref[0].copy()}) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bad = compare(ref, {0: np.array([np.inf, np.inf, 1.0])})
    assert "1 of 3 values differ" in bad[0].message and "largest difference inf" in bad[0].message


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_integer_outputs_past_2_53_are_compared_exactly_not_through_float64(dtype):
    """An engine's probe may return an integer fingerprint of each layer's output: two that differ only below
    float64's 53 bits are a mismatch (isclose's float64 cast made them equal), and a tolerance applies exactly."""
    top = int(np.iinfo(dtype).max)
    ref = {0: np.array([top, 2**60], dtype)}
    assert compare(ref, {0: ref[0].copy()}) == []
    bad = compare(ref, {0: np.array([top - 1, 2**60], dtype)})
    assert [m.layer for m in bad] == [0] and "1 of 2 values differ" in bad[0].message
    assert compare(ref, {0: np.array([top - 1, 2**60 + 1], dtype)}, atol=1) == []
    assert [m.layer for m in compare(ref, {0: np.array([top, 2**60 + 2], dtype)}, atol=1)] == [0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_paddle_low_precision_float_output_is_compared_as_its_values_not_its_bits(dtype):
    """paddle's numpy() of a bfloat16 / float8 tensor gives its raw bits as integers: a tolerance applied to
    those let 1.0 -> 1.5 agree within rtol 0.01, and a NaN was no NaN. Compared as floats, both are caught."""
    paddle = pytest.importorskip("paddle")
    out = outputs_of([paddle.to_tensor([1.0, 2.0]).astype(dtype)])
    assert out[0].dtype.kind == "f" and out[0].tolist() == [1.0, 2.0]
    before = {0: paddle.to_tensor([1.0, 2.0]).astype(dtype)}
    bad = _run(before, {0: paddle.to_tensor([1.5, 2.0]).astype(dtype)}, rtol=0.01).result
    assert bad.outcome is ProbeOutcome.MISMATCH and "largest difference 0.5" in bad.message
    nan = paddle.to_tensor([float("nan"), 2.0]).astype(dtype)
    if dtype == "bfloat16":  # float8_e4m3fn has a NaN too, but paddle's cast to it saturates on CPU
        assert "NaN" in _run({0: nan}, {0: nan}).result.message


class _TorchLike:
    """What outputs_of sees of a torch tensor (torch is not installed here): its module, dtype name, detach /
    float / cpu, and a numpy() that raises as torch's does for a CUDA or bfloat16 tensor."""

    __module__ = "torch"

    def __init__(self, values, dtype="torch.bfloat16", device="cuda:0"):
        self.values, self.dtype, self.device = np.asarray(values, np.float32), dtype, device

    def detach(self):
        return self

    def float(self):
        return _TorchLike(self.values, "torch.float32", self.device)

    def cpu(self):
        return _TorchLike(self.values, self.dtype, "cpu")

    def numpy(self):
        if self.device != "cpu":
            raise TypeError(f"can't convert {self.device} device type tensor to numpy")
        if self.dtype == "torch.bfloat16":
            raise TypeError("Got unsupported ScalarType BFloat16")
        return self.values.copy()


def test_a_torch_bfloat16_output_on_a_gpu_is_read_through_a_float32_host_copy():
    """A torch engine's probe output (bfloat16, on its GPU): numpy() raised, so every swap's probe failed and was
    rolled back. Checked against a stand-in with torch's behaviour (torch itself is not installed here)."""
    out = outputs_of([_TorchLike([1.0, 2.0])])
    assert out[0].dtype == np.float32 and out[0].tolist() == [1.0, 2.0]
    assert outputs_of([_TorchLike([3.0], "torch.float16")])[0].tolist() == [3.0]
    run = _run([_TorchLike([1.0, 2.0])], [_TorchLike([1.0, 2.0])])
    assert run.result.outcome is ProbeOutcome.AGREE


def test_a_changed_shape_dtype_or_layer_set_is_a_mismatch_saying_so():
    ref = {0: np.zeros((2, 3), np.float32), 1: np.zeros(2, np.float32)}
    bad = compare(ref, {0: np.zeros((3, 2), np.float32), 1: np.zeros(2, np.float64), 2: np.zeros(1)})
    assert [m.layer for m in bad] == [0, 1, 2]
    assert "float32 [3, 2] after the swap, float32 [2, 3] before" in bad[0].message
    assert "float64 [2] after the swap, float32 [2] before" in bad[1].message
    assert "after the swap only" in bad[2].message


# ---- one swap's run ------------------------------------------------------------------------------------------------
def test_a_run_agrees_or_names_its_layers_and_keeps_the_reference_after_a_failure():
    same = _run({0: [1.0], 1: [2.0]}, {0: [1.0], 1: [2.0]})
    assert same.result.outcome is ProbeOutcome.AGREE and same.trusted() is None
    assert same.result.fields()["probe"] == "agree" and same.result.before_ms >= 0
    bad = _run({0: [1.0], 1: [2.0]}, {0: [1.0], 1: [2.5]})
    assert bad.result.outcome is ProbeOutcome.MISMATCH and bad.result.layers == (1,)
    assert bad.result.fields()["probe_layers"] == "1" and "layer 1" in bad.result.message
    kept = bad.trusted()  # the outputs of the placement before the failed swap: what a rollback must give again
    assert np.array_equal(kept[1], [2.0])
    back = _run({0: [9.0], 1: [9.0]}, {0: [1.0], 1: [2.0]}, reference=kept)  # its before is the garbage
    assert back.result.outcome is ProbeOutcome.AGREE


def test_a_probe_that_raises_is_a_failed_probe_with_the_exception_text():
    after = _run({0: [1.0]}, ZeroDivisionError("no tokens"))
    assert after.result.outcome is ProbeOutcome.FAILED and after.result.failed
    assert after.result.message == "probe raised after the swap: ZeroDivisionError: no tokens"
    before = _run(RuntimeError("cuda"), {0: [1.0]})
    assert before.result.message == "probe raised before the swap: RuntimeError: cuda"
    assert _run(RuntimeError("x"), {0: [1.0]}, reference={0: np.array([1.0])}).result.outcome is ProbeOutcome.AGREE
    wrong = _run({0: [1.0]}, "not per layer")  # a wrong return type after the swap: failed, with the reason
    assert wrong.result.outcome is ProbeOutcome.FAILED and "one output per MoE layer" in wrong.result.message


def test_the_audited_reason_is_derived_from_its_detail():
    why = reasons.probe_mismatch([{"ep_rank": 2, "outcome": "failed", "layers": [], "message": "E: x"},
                                  {"ep_rank": 0, "outcome": "mismatch", "layers": [1, 3], "message": "m" * 300}])
    assert why.text == f"probe_mismatch: rank 0 layers [1, 3] ({'m' * 200}); rank 2 failed (E: x)"
    record = {"trigger": "swapped", "reason": why.text, "detail": json.dumps(why.detail)}
    assert reasons.probe_mismatch(reasons.probe_mismatches(record)).text == why.text


# ---- a threaded cluster whose probe raises -----------------------------------------------------------------------
def test_a_probe_that_raises_after_the_swap_is_rolled_back_and_the_loop_goes_on(redis_url, cluster_id, tmp_path):
    calls = {r: 0 for r in range(4)}

    def probe_of(r):
        def probe():  # placement-independent outputs; rank 2 raises on its second call (round 1's after)
            calls[r] += 1
            if r == 2 and calls[r] == 2:
                raise ZeroDivisionError("the probe batch routed no token")
            return {0: np.arange(3, dtype=np.float32), 1: np.ones((2, 2))}
        return probe

    with probed_cluster(redis_url, cluster_id, tmp_path, probe_of) as tc:
        store = tc.store()
        before = store.current_placement()
        store.request_round("test raising probe")
        wait_for(lambda: round_done(store, 2), 60, store, "round 1 and its rollback")
        audit = [a.fields for a in store.audit() if a["machine"] == "cluster"]
        swapped = [a for a in audit if a["trigger"] == "swapped"]
        assert [a["round"] for a in swapped] == ["1", "2"]
        assert json.loads(swapped[0]["detail"])["probe_mismatch"] == [
            {"ep_rank": 2, "outcome": "failed", "layers": [],
             "message": "probe raised after the swap: ZeroDivisionError: the probe batch routed no token"}]
        assert swapped[1]["reason"] == ""
        load = [a for a in audit if a["trigger"] == "load"][1]
        assert json.loads(load["detail"])["supplied"]["undoes"] == 1
        assert np.array_equal(store.current_placement().phy2log, before.phy2log)
        assert store.read_rank(2).probe == "agree" and store.read_cluster().probe_mismatch == ""
        assert all(t.is_alive() for t in tc.threads), "an agent loop died"


# ---- a supplied placement the round cannot go to -----------------------------------------------------------------
def test_a_supplied_placement_that_drops_an_expert_aborts_its_round_and_is_dropped(redis_url, cluster_id, tmp_path):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        tc.start_agents()
        tc.start_coordinator()
        store = tc.store()
        before = store.current_placement()
        bad = before.phy2log.copy()
        bad[0, bad[0] == 3] = 4  # logical expert 3 of layer 0 has no slot left
        store.supply_placement(bad, {"kind": "rollback", "undoes": 1, "plan_id": "", "why": "test"})
        with pytest.raises(InputError, match="supplied placement"):
            store.supply_placement(bad[:, :-1], {"kind": "rollback", "undoes": 1})  # a wrong shape: refused
        store.request_round("test supplied")
        rec = wait_for(lambda: round_done(store, 1), 60, store, "round 1")
        assert "without a replica on a member" in rec.reason and "(0, 3)" in rec.reason, rec.reason
        assert store.supplied_placement() is None  # dropped: never retried
        assert np.array_equal(store.current_placement().phy2log, before.phy2log)
