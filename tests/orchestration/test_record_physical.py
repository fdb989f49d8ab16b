"""``record(counts, physical=...)`` takes a bool or None only (QA of the serving hot path, item 3): the string
"false" was taken as True (``bool("false")``), so logical counts of an E == P cluster were folded as per-slot ones,
or a [L, E] step refused with a shape message naming physical=True. Host and device paths, nothing recorded."""

from __future__ import annotations

import numpy as np
import pytest

from fdeplb.errors import InputError
from fdeplb.orchestration.load_window import ExpertLoadWindow, LoadRecorder

L, E, P = 2, 4, 6


def _started() -> LoadRecorder:
    rec = LoadRecorder()
    rec._init_load(None, 8, None, None)
    rec.window = ExpertLoadWindow(L, E, steps=8)
    rec._live_phy2log = np.tile(np.arange(P) % E, (L, 1)).astype(np.int64)
    return rec


def _tensor(arr: np.ndarray):
    paddle = pytest.importorskip("paddle")
    return paddle.to_tensor(arr)


@pytest.mark.parametrize("device", [False, True])
@pytest.mark.parametrize("bad", ["false", "True", 0, 1, "", [], "physical"])
def test_physical_that_is_not_a_bool_is_refused_and_nothing_recorded(bad, device):
    rec = _started()
    counts = np.ones((L, E), np.int32)
    for _ in range(2):  # every time, not only the first (the device path remembers kinds)
        with pytest.raises(InputError, match=r"physical must be True, False or None, got "):
            rec.record(_tensor(counts) if device else counts, physical=bad)
    assert len(rec.window) == 0


@pytest.mark.parametrize("device", [False, True])
def test_physical_bools_and_none_still_work(device):
    rec = _started()
    for physical, shape in [(False, (L, E)), (np.bool_(False), (L, E)), (True, (L, P)), (np.bool_(True), (L, P)),
                            (None, (L, E)), (None, (L, P))]:
        arr = np.ones(shape, np.int64)
        rec.record(_tensor(arr) if device else arr, physical=physical)
    assert rec.window.total().tolist() == [[3 + 3 * 2, 3 + 3 * 2, 3 + 3, 3 + 3]] * L
