"""QA3: attacks on the chunked swap's identity checks (commit 41e74ea)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("paddle")

from fdeplb.errors import InputError, WeightError  # noqa: E402
from fdeplb.weights import CheckpointReader, LiveExperts, routing_tables, stage_experts  # noqa: E402
from fdeplb.weights.plan import plan_transfer  # noqa: E402
from tests.weights.helpers import EP, NEW, OLD  # noqa: E402


def test_chunk_loaded_on_one_live_experts_is_refused_by_another_at_the_same_epoch(ckpt):
    """The chunk stores no identity of the LiveExperts it was loaded against, only an epoch count; two wrappers
    (e.g. a re-attach) both at epoch 0 accept each other's chunk: B's books say NEW while A's tables/slots change."""
    reader = CheckpointReader(ckpt)
    a = LiveExperts.from_checkpoint(reader, OLD, 0, EP, device="cpu")
    b = LiveExperts.from_checkpoint(reader, OLD, 0, EP, device="cpu")
    assert a.epoch == b.epoch
    plan = plan_transfer(OLD, NEW, 0, EP)
    staged = stage_experts(plan, reader, device="cpu", buffer_experts=len(plan.disk))
    a.load_chunk(plan, staged, NEW, (0,))
    try:
        b.swap_layers(plan, staged, NEW, (0,))
    except WeightError:
        return  # refused: the expected behaviour
    new_l2p = routing_tables(NEW, 8, b.max_replicas)[0]
    # it was applied through b: b must then route layer 0 by NEW on its own tables (it does not)
    assert np.array_equal(b.phy2log[0], NEW[0])
    assert np.array_equal(b.log2phy.numpy()[0], new_l2p[0]), "b's routing tables keep OLD while b.phy2log says NEW"
    assert np.array_equal(b.phy2log_tensor.numpy()[0], NEW[0])


def test_load_chunk_and_swap_layers_agree_on_duplicated_layers(ckpt):
    """load_chunk dedups layers (sorted(set)), _loaded_chunk only sorts: (0, 0) loads but never applies."""
    reader = CheckpointReader(ckpt)
    live = LiveExperts.from_checkpoint(reader, OLD, 0, EP, device="cpu")
    plan = plan_transfer(OLD, NEW, 0, EP)
    staged = stage_experts(plan, reader, device="cpu", buffer_experts=len(plan.disk))
    live.load_chunk(plan, staged, NEW, (0, 0))
    live.swap_layers(plan, staged, NEW, (0, 0))
    assert np.array_equal(live.phy2log[0], NEW[0])


@pytest.mark.parametrize("layers", [(-1,), (3,), (), (0.5,), ("0",), (True,), None])
def test_a_chunk_of_no_layer_or_of_layers_outside_the_model_is_refused_and_changes_nothing(ckpt, layers):
    """A negative layer must not count from the end (numpy would take (-1,) as the last layer's rows), a float or
    a bool must not be truncated to a layer, and an empty chunk is no chunk: InputError from both steps, nothing
    loaded or applied, the epoch unchanged."""
    reader = CheckpointReader(ckpt)
    live = LiveExperts.from_checkpoint(reader, OLD, 0, EP, device="cpu")
    plan = plan_transfer(OLD, NEW, 0, EP)
    staged = stage_experts(plan, reader, device="cpu", buffer_experts=len(plan.disk))
    epoch, p2l = live.epoch, live.phy2log.copy()
    with pytest.raises(InputError):
        live.load_chunk(plan, staged, NEW, layers)
    assert staged.buffer is None or staged.buffer.chunk is None
    with pytest.raises(InputError):
        live.swap_layers(plan, staged, NEW, layers)
    assert live.epoch == epoch and np.array_equal(live.phy2log, p2l)
    # a real chunk still loads and applies afterwards
    live.load_chunk(plan, staged, NEW, (OLD.shape[0] - 1,))
    live.swap_layers(plan, staged, NEW, (OLD.shape[0] - 1,))
    assert np.array_equal(live.phy2log[-1], NEW[-1])
