"""The output probe: a swap checked by what the model computes, not only by checksums.

Checksums verify that every slot holds its logical expert's bytes; they pass when the right bytes sit in the wrong
layout (the silent garbage after a rebalance of sglang#25355). An engine may therefore register a *probe*
(:meth:`fdeplb.orchestration.agent.RankAgent.set_probe`): a fixed input run through its MoE layers, returning one
output per MoE layer whose value does not depend on the placement (the routing tables and the live slots change
together, the model's function does not). Each rank runs it inside its safe point (no forward runs meanwhile)
**before the switch** (the old placement) and **after its last chunk** (the new one); the two must agree within the
engine's tolerance (bit-exact by default: the same kernels on the same input).

This module owns the probe's contract: :class:`Probe` (the function and its tolerance), :func:`outputs_of` (what a
probe may return, checked), :func:`compare` (the tolerance rule, per layer) and :class:`ProbeRun` (one swap's
before / after, the exception of a probe that raises, the timings, and the :class:`ProbeResult` the rank record
reports) and :class:`Probing`, the rank agent's side of it (:meth:`Probing.set_probe`). No I/O of its own; paddle
tensors are read through their ``numpy()`` (the only host copy, at a safe point).

**The reference.** A rank compares the *after* outputs with the outputs of the last placement it trusts: the
*before* of this swap, unless its previous swap's probe failed (then its live slots are suspect, and the reference
stays the *before* of that failed swap: the placement a rollback goes back to). A rank's first probe trusts its
*before*.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from fdeplb.errors import InputError
from fdeplb.weights import dtype_name

__all__ = ["Probe", "ProbeOutcome", "ProbeResult", "ProbeRun", "Probing", "compare", "outputs_of"]

#: most characters of a probe's message kept in the rank record (the audit names every layer anyway)
MAX_MESSAGE = 500
#: float dtypes numpy has no type for, compared as float32: paddle's ``numpy()`` gives their raw bits as integers
#: (a tolerance would then apply to bit patterns, and a NaN would be no NaN), torch's raises
RAW_BITS = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2"})


class ProbeOutcome(str, Enum):
    """A swap's probe as the rank record reports it (``probe``); ``""``: no probe registered."""

    NONE = ""
    AGREE = "agree"        # every layer within the tolerance
    MISMATCH = "mismatch"  # a layer differs or holds a NaN, or the outputs' layers, shapes or dtypes changed
    FAILED = "failed"      # the probe raised (its exception's text is the message)


@dataclass(frozen=True)
class Probe:
    """A registered probe: ``fn()`` -> one output per MoE layer (see :func:`outputs_of`); ``rtol`` / ``atol``: the
    tolerance of :func:`compare` (0, 0: bit-exact). :class:`~fdeplb.errors.InputError` for a ``fn`` that is not
    callable or a tolerance that is negative or not finite."""

    fn: Callable[[], Any]
    rtol: float = 0.0
    atol: float = 0.0

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise InputError(f"a probe must be callable, got {type(self.fn).__name__}")
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
                raise InputError(f"probe {name} must be a finite number >= 0, got {value!r}")


def outputs_of(value: Any) -> dict[int, np.ndarray]:
    """A probe's return value as ``{layer: ndarray}``: a mapping of MoE layer index (int >= 0) to an array, or a
    sequence of arrays (index = layer). An array is anything with ``numpy()`` (a paddle or torch tensor) or that
    ``numpy.asarray`` takes, numeric; a paddle or torch bfloat16 / float8 tensor is read as float32
    (:data:`RAW_BITS`), a torch tensor on a GPU through a host copy. :class:`~fdeplb.errors.InputError` naming the
    problem otherwise (no layers, a key that is not a layer index, an object or string array)."""
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        items = list(enumerate(value))
    else:
        raise InputError(f"a probe returns one output per MoE layer (a dict layer -> array or a list), got "
                         f"{type(value).__name__}")
    if not items:
        raise InputError("a probe returned no layer")
    out: dict[int, np.ndarray] = {}
    for layer, arr in items:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0:
            raise InputError(f"a probe's layer key must be an int >= 0, got {layer!r}")
        module = type(arr).__module__.partition(".")[0]
        if module == "paddle" and dtype_name(arr) in RAW_BITS:
            arr = arr.astype("float32")  # exact: every bfloat16 / float8 value is a float32 one
        elif module == "torch":  # its numpy() raises for a CUDA or bfloat16 tensor (a failed probe every swap)
            arr = arr.detach()
            arr = (arr.float() if dtype_name(arr).replace("torch.", "") in RAW_BITS else arr).cpu()
        data = arr.numpy() if hasattr(arr, "numpy") else arr
        data = np.array(data, copy=True)  # a snapshot: the engine may reuse its buffers
        if data.dtype.kind not in "biufc":
            raise InputError(f"a probe's output of layer {layer} is {data.dtype}, not numeric")
        out[int(layer)] = data
    return out


@dataclass(frozen=True)
class LayerMismatch:
    """One layer whose probe outputs disagree: ``layer`` and what differs (``message``)."""

    layer: int
    message: str


def compare(reference: Mapping[int, np.ndarray], outputs: Mapping[int, np.ndarray], rtol: float = 0.0,
            atol: float = 0.0) -> list[LayerMismatch]:
    """The layers whose ``outputs`` disagree with ``reference`` (both as :func:`outputs_of` gives them), in
    layer order; empty when they agree. A layer agrees when both have it with the same shape and dtype, neither
    holds a NaN, and ``|out - ref| <= atol + rtol * |ref|`` elementwise (``numpy.isclose``'s rule; integers exactly,
    in Python ints, not through float64); with ``rtol = atol = 0`` that is bit-exact equality of the values. A layer only one side has, or whose shape or dtype
    changed, is a mismatch saying so; so is a NaN on either side (all-NaN outputs before and after included: a NaN
    output checks nothing), saying how many values are NaN after and before the swap."""
    out: list[LayerMismatch] = []
    for layer in sorted(set(reference) | set(outputs)):
        ref, got = reference.get(layer), outputs.get(layer)
        if ref is None or got is None:
            out.append(LayerMismatch(layer, f"layer {layer}: an output {'after' if ref is None else 'before'} the "
                                            f"swap only"))
            continue
        if ref.shape != got.shape or ref.dtype != got.dtype:
            out.append(LayerMismatch(layer, f"layer {layer}: output {got.dtype} {list(got.shape)} after the swap, "
                                            f"{ref.dtype} {list(ref.shape)} before"))
            continue
        nan_got, nan_ref = _nan_count(got), _nan_count(ref)
        if nan_got or nan_ref:
            out.append(LayerMismatch(layer, f"layer {layer}: {nan_got} of {got.size} values NaN after the swap, "
                                            f"{nan_ref} before (a NaN output never agrees)"))
            continue
        exact = got.dtype.kind in "iu"  # integers exactly: isclose's float64 cast drops bits past 2**53
        if exact and rtol == atol == 0:
            ok = got == ref
        elif exact:  # in Python ints (object arrays: slow, but only a tolerance on integer outputs takes it)
            ok = np.asarray(_int_diff(got, ref) <= atol + rtol * np.abs(ref.astype(object)), dtype=bool)
        else:
            ok = np.isclose(got, ref, rtol=rtol, atol=atol)
        if not ok.all():
            with np.errstate(invalid="ignore"):  # inf - inf where both are the same inf: agreeing, masked below
                diff = _int_diff(got, ref) if exact else np.abs(
                    got.astype(np.complex128 if got.dtype.kind == "c" else np.float64)
                    - ref.astype(np.complex128 if ref.dtype.kind == "c" else np.float64))
            bad = int((~ok).sum())
            worst = float(np.max(np.where(ok, 0.0, diff)))
            out.append(LayerMismatch(layer, f"layer {layer}: {bad} of {ok.size} values differ beyond rtol {rtol} "
                                            f"atol {atol} (largest difference {worst:.6g})"))
    return out


def _int_diff(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """``|got - ref|`` of two integer arrays, exactly (Python ints in an object array: no wrap, no rounding)."""
    return np.abs(got.astype(object) - ref.astype(object))


def _nan_count(values: np.ndarray) -> int:
    """How many of ``values`` are NaN (a complex value with a NaN part counts); 0 for an integer or bool array."""
    return int(np.isnan(values).sum()) if values.dtype.kind in "fc" else 0


@dataclass(frozen=True)
class ProbeResult:
    """What a swap's probe found, as the rank record reports it (:meth:`fields`)."""

    outcome: ProbeOutcome = ProbeOutcome.NONE
    layers: tuple[int, ...] = ()
    message: str = ""
    before_ms: float = 0.0
    after_ms: float = 0.0

    @property
    def failed(self) -> bool:
        """A mismatch or a probe that raised: LOAD_FAILED-level, the coordinator rolls the round back."""
        return self.outcome in (ProbeOutcome.MISMATCH, ProbeOutcome.FAILED)

    def fields(self) -> dict[str, Any]:
        """The rank-record fields (``probe``, ``probe_layers``, ``probe_message``, ``probe_before_ms``,
        ``probe_after_ms``)."""
        return {"probe": self.outcome.value, "probe_layers": ",".join(map(str, self.layers)),
                "probe_message": self.message[:MAX_MESSAGE], "probe_before_ms": round(self.before_ms, 3),
                "probe_after_ms": round(self.after_ms, 3)}


@dataclass
class ProbeRun:
    """One swap's probe: :meth:`before` runs it on the old placement (before the first chunk), :meth:`after` on
    the new one (after the last chunk), both called by :class:`~fdeplb.orchestration.safe_points.SafePointOp`
    inside the worker's safe point. Neither raises: a probe that raises is a failed probe with the exception's
    type and text (:attr:`result`). ``reference``: the outputs of the last placement the rank trusts (None: trust
    this swap's *before*, see the module doc)."""

    probe: Probe
    reference: dict[int, np.ndarray] | None = None
    before_outputs: dict[int, np.ndarray] | None = None
    result: ProbeResult = field(default_factory=ProbeResult)
    _before_error: str = ""
    _before_ms: float = 0.0
    _ran_before: bool = False

    def before(self) -> None:
        """Run the probe on the old placement (once per swap)."""
        if self._ran_before:
            return
        self._ran_before = True
        t0 = time.perf_counter()
        try:
            self.before_outputs = outputs_of(self.probe.fn())
        except Exception as err:  # noqa: BLE001 - any probe failure is reported, never raised into the swap
            self._before_error = f"probe raised before the swap: {type(err).__name__}: {err}"
        self._before_ms = (time.perf_counter() - t0) * 1000

    def after(self) -> None:
        """Run the probe on the new placement and compare with the reference (sets :attr:`result`). A probe
        that raised before the swap fails it only when that *before* was to be the reference."""
        t0 = time.perf_counter()
        error = ""
        try:
            outputs = outputs_of(self.probe.fn())
        except Exception as err:  # noqa: BLE001 - as in before()
            outputs, error = None, f"probe raised after the swap: {type(err).__name__}: {err}"
        after_ms = (time.perf_counter() - t0) * 1000
        reference = self.reference if self.reference is not None else self.before_outputs
        if outputs is None or reference is None:
            message = error or self._before_error or "the probe did not run before the swap"
            self.result = ProbeResult(ProbeOutcome.FAILED, (), message, self._before_ms, after_ms)
            return
        bad = compare(reference, outputs, self.probe.rtol, self.probe.atol)
        if bad:
            self.result = ProbeResult(ProbeOutcome.MISMATCH, tuple(m.layer for m in bad),
                                      "; ".join(m.message for m in bad), self._before_ms, after_ms)
        else:
            self.result = ProbeResult(ProbeOutcome.AGREE, (), "", self._before_ms, after_ms)

    def trusted(self) -> dict[int, np.ndarray] | None:
        """The reference the rank keeps for its next swap: this swap's *after* is not kept (the next *before*
        reruns it); the *before* of a swap that went wrong stays the reference, else None (trust the next
        *before*)."""
        if not self.result.failed:
            return None
        return self.reference if self.reference is not None else self.before_outputs


class Probing:
    """The rank agent's side of the probe, mixed into :class:`~fdeplb.orchestration.agent.RankAgent`: the registered
    probe, the reference it keeps between swaps, a :class:`ProbeRun` per swap and its report. It uses, of its host:
    ``log``, ``store`` and ``ep_rank``."""

    log: Any
    store: Any
    ep_rank: int

    def _init_probe(self) -> None:
        self._probe: Probe | None = None
        self._probe_reference: dict[int, np.ndarray] | None = None

    def set_probe(self, fn: Callable[[], Any] | None, *, rtol: float = 0.0, atol: float = 0.0) -> None:
        """Register the engine's output probe (None: remove it): ``fn()`` runs a fixed input through the MoE layers
        and returns one output per MoE layer (a dict layer -> array, or a list; paddle / numpy arrays) that does
        not depend on the placement. Every swap runs it inside the worker's safe point before the switch and
        after its last chunk; the outputs must agree within ``rtol`` / ``atol`` (``numpy.isclose``'s rule; 0, 0:
        bit-exact, right for the same kernels). A mismatch, or a probe that raises, is reported in the rank
        record (``probe``, ``probe_layers``, ``probe_message``, ``probe_before_ms`` / ``probe_after_ms``) and the
        coordinator rolls the round back (:mod:`~fdeplb.orchestration.rollback`, README "A swap checked by its
        output"). :class:`~fdeplb.errors.InputError` for a ``fn`` that is not callable or a bad tolerance (the
        probe registered before stays)."""
        probe = None if fn is None else Probe(fn, rtol, atol)
        self._probe, self._probe_reference = probe, None

    def _probe_run(self) -> ProbeRun | None:
        """A run of the registered probe for the next swap (None without one), against the kept reference."""
        return None if self._probe is None else ProbeRun(self._probe, self._probe_reference)

    def _probe_report(self, run: ProbeRun | None) -> dict[str, Any]:
        """The rank-record fields of a swap's probe (all cleared without one); keeps the reference the next swap
        compares with (:meth:`ProbeRun.trusted`); a failed probe is logged, announced (an ``alarm`` event) and is
        the rank record's ``reason``."""
        if run is None:
            return ProbeResult().fields()
        self._probe_reference = run.trusted()
        result = run.result
        if not result.failed:
            return result.fields()
        why = f"probe {result.outcome.value} after the swap: {result.message}"[:MAX_MESSAGE]
        self.log.error("probe failed after the swap", probe=result.outcome.value, layers=list(result.layers),
                       message=result.message[:MAX_MESSAGE])
        self.store.emit_event("alarm", rank=self.ep_rank, message=why)
        return {**result.fields(), "reason": why}
