"""attacks on the chunked swap's inputs: the layers of LiveExperts.load_chunk / swap_layers
(``_chunk_of``) and the pause budget a backend stages with."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("paddle")

from fdeplb.errors import InputError  # noqa: E402
from fdeplb.weights import CheckpointBackend, CheckpointReader, LiveExperts, stage_experts  # noqa: E402
from fdeplb.weights.plan import PauseBudget, plan_transfer  # noqa: E402
from tests.weights.helpers import EP, NEW, OLD  # noqa: E402


def _round(ckpt):
    reader = CheckpointReader(ckpt)
    live = LiveExperts.from_checkpoint(reader, OLD, 0, EP, device="cpu")
    plan = plan_transfer(OLD, NEW, 0, EP)
    return live, plan, stage_experts(plan, reader, device="cpu", buffer_experts=len(plan.disk))


def _state(live):
    return (live.epoch, live.phy2log.tobytes(), live.phy2log_tensor.numpy().tobytes(),
            live.log2phy.numpy().tobytes(), live.logcnt.numpy().tobytes(),
            tuple(t.numpy().tobytes() for layers in live.tensors.values() for t in layers))


# Each of these is accepted today and silently read as other layers: "10" (layer ten, to the caller) is
# layers (0, 1); a bool mask of layers 0 and 2 is layers (0, 1); 2.7 is layer 2; True is layer 1; b"\x00" is
# layer 0; a dict is its keys.
@pytest.mark.parametrize("layers", ["10", "2", b"\x00", [2.7], [0.5], [True], np.array([True, False, True]),
                                    np.array([0.0, 2.0]), {0: 2}],
                         ids=["str-10", "str-2", "bytes", "float-2.7", "float-0.5", "bool", "bool-mask",
                              "float-array", "dict"])
def test_load_chunk_refuses_layers_that_are_not_integers(ckpt, layers):
    live, plan, staged = _round(ckpt)
    before = _state(live)
    with pytest.raises(InputError, match="layer"):
        live.load_chunk(plan, staged, NEW, layers)
    assert _state(live) == before and staged.buffer.chunk is None


# Malformed layers escape as raw TypeError / IndexError / ValueError / OverflowError (not the documented InputError).
@pytest.mark.parametrize("layers", [None, 3, [[0], [2]], np.array([[0, 2]]), [3], [2**70], [2**63],
                                    [float("nan")], [float("inf")]],
                         ids=["none", "scalar", "nested", "2d-array", "past-last", "huge", "2**63", "nan", "inf"])
def test_load_chunk_malformed_layers_are_an_input_error(ckpt, layers):
    live, plan, staged = _round(ckpt)
    before = _state(live)
    with pytest.raises(InputError):
        live.load_chunk(plan, staged, NEW, layers)
    assert _state(live) == before


@pytest.mark.parametrize("bad", [[-1], [-3], [-3, 2]], ids=["-1", "-3", "-3-and-2"])
def test_a_negative_layer_is_refused_up_front_and_keeps_the_loaded_chunk(ckpt, bad):
    """A negative layer passes load_chunk's placement checks (numpy reads -1 as the last row), the buffer's chunk is
    dropped (and for [-3, 2] layer 2's experts copied into the buffer), and only then does the routing RowCopy
    refuse it, with a ValueError. Expected: InputError before anything, the chunk loaded before still applicable."""
    live, plan, staged = _round(ckpt)
    live.load_chunk(plan, staged, NEW, (0,))
    before = _state(live)
    with pytest.raises(InputError, match="layer"):
        live.load_chunk(plan, staged, NEW, bad)
    assert _state(live) == before
    assert staged.buffer.chunk is not None and staged.buffer.chunk.layers == (0,)
    live.swap_layers(plan, staged, NEW, (0,))
    assert np.array_equal(live.phy2log[0], NEW[0])


@pytest.mark.parametrize("budget", [PauseBudget(-1, 0), PauseBudget(0, -1), PauseBudget("64", 0),
                                    PauseBudget(1.9, 0), PauseBudget(True, 0)],
                         ids=["neg-bytes", "neg-layers", "str", "float", "bool"])
def test_backend_stage_refuses_a_pause_budget_check_pause_budget_refuses(ckpt, budget):
    """(low) The backend's stage() takes a PauseBudget as is: -1 bytes puts every layer in a chunk of its own,
    "64" / 1.9 / True are int()-ed. The cluster and the agent refuse these (check_pause_budget); stage() did not.
    (A budget above the cluster's 2**62 cap is, to the chunking, no byte limit: stage() accepts it.)"""
    b = CheckpointBackend.open({"path": str(ckpt)}, OLD, 0, EP, device="cpu")
    with pytest.raises(InputError):
        b.stage(NEW, None, budget)
