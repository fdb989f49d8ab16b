"""The chunked swap when something goes wrong: a chunk that fails and is retried, a device buffer that does not hold
what was staged, an error other than a failed verification in the pause, and the batch of checked row copies
(:func:`fdeplb.weights._paddle.copy_rows_checked`) given bad input or interrupted while its threads write."""

from __future__ import annotations

import ctypes
import signal
import threading

import numpy as np
import pytest

pytest.importorskip("paddle")

from fdeplb.errors import InputError, VerificationError, WeightError  # noqa: E402
from fdeplb.orchestration.agent import RankAgent  # noqa: E402
from fdeplb.weights import CheckpointBackend  # noqa: E402
from fdeplb.weights import _paddle  # noqa: E402
from fdeplb.weights.plan import PauseBudget, changed_layers, chunk_layers  # noqa: E402
from tests.weights.helpers import EP, NEW, OLD, snapshot_bytes  # noqa: E402

L = OLD.shape[0]
R = _paddle.RowCopy


def backend(ckpt_dir) -> CheckpointBackend:
    return CheckpointBackend.open({"path": str(ckpt_dir)}, OLD, 0, EP, device="cpu")


def test_a_failed_chunk_reloads_and_the_same_chunk_retries_to_the_whole_swaps_end_state(ckpt, monkeypatch):
    whole = backend(ckpt)
    whole.swap(whole.stage(NEW, None), NEW)
    b = backend(ckpt)
    staged = b.stage(NEW, None, PauseBudget(0, 1))
    chunks = chunk_layers(staged.starts, changed_layers(OLD, NEW))
    b.prepare(staged, NEW, chunks[0])
    real, n = _paddle._copy_bytes, []

    def short(d, s, k):  # the 2nd raw copy of the pause lands a byte short, that byte wrong
        n.append(k)
        out = real(d, s, k - 1 if len(n) == 2 else k)
        if len(n) == 2:
            ctypes.c_ubyte.from_address(d + k - 1).value = ctypes.c_ubyte.from_address(s + k - 1).value ^ 0x40
        return out

    monkeypatch.setattr(_paddle, "_copy_bytes", short)
    with pytest.raises(VerificationError):
        b.swap_layers(staged, NEW, chunks[0])
    monkeypatch.undo()
    b.reload()
    assert b.verify() == (L * 6, L * 6)
    for layers in chunks:
        b.prepare(staged, NEW, layers)
        b.swap_layers(staged, NEW, layers)
    assert snapshot_bytes(b.live) == snapshot_bytes(whole.live)
    assert np.array_equal(b.phy2log, NEW) and b.verify() == (L * 6, L * 6)


def test_a_device_buffer_that_does_not_hold_the_staged_bytes_is_refused_before_the_pause(ckpt, monkeypatch):
    """The copy into the chunk's device buffer is checked when the chunk is loaded (outside the pause): one byte
    that does not land there is a VerificationError naming the expert, the buffer holds no chunk, nothing live is
    written; loading the chunk again and applying it ends where the whole swap ends (QA: the bad byte used to be
    copied into two live slots and pass the pause's check, which compares slots with the buffer)."""
    b = backend(ckpt)
    staged = b.stage(NEW, None, PauseBudget(0, 1))
    before = snapshot_bytes(b.live)
    real, calls = _paddle._copy_bytes, []

    def lands_wrong(d, s_, n):  # the first raw copy of the load (the first buffer entry) gets its last byte wrong
        calls.append(n)
        out = real(d, s_, n)
        if len(calls) == 1:  # (a short copy could leave a right byte behind: the buffer's memory is reused)
            last = ctypes.c_ubyte.from_address(d + n - 1)
            last.value ^= 0x40
        return out

    monkeypatch.setattr(_paddle, "_copy_bytes", lands_wrong)
    with pytest.raises(VerificationError, match=r"device buffer's copy of staged expert\(s\) \(layer, expert\) \[\(0, "):
        b.prepare(staged, NEW, (0,))
    monkeypatch.undo()
    assert calls and staged.experts.buffer.layers == () and not b.live.needs_reload
    assert snapshot_bytes(b.live) == before
    with pytest.raises(WeightError, match="load_chunk"):
        b.swap_layers(staged, NEW, (0,))  # the buffer holds no chunk: refused, not applied from a bad buffer
    for layers in chunk_layers(staged.starts, changed_layers(OLD, NEW)):
        b.prepare(staged, NEW, layers)
        b.swap_layers(staged, NEW, layers)
    assert np.array_equal(b.phy2log, NEW) and b.verify() == (L * 6, L * 6)


def test_an_error_other_than_a_failed_verification_in_a_chunks_pause_restores_the_rank(ckpt, monkeypatch):
    """A chunk's pause that fails after its local copies ran with anything but VerificationError (a device error in
    the batch of disk writes here; out of memory in a snapshot, a copy thread) is re-raised by the agent's swap
    after it reloaded the live placement: the slots match the routing again and the next attempt may swap (QA:
    the rank was left half-written, and every later attempt failed with 'reload() before swapping')."""
    new = OLD.copy()
    new[0] = [1, 0, 3, 3, 6, 5, 6, 7, 0, 1, 2, 4]  # rank 0: slots 0/1 exchange (snapshot), 2 <- 3 (local), 4 <- 6 (disk)
    b = backend(ckpt)
    staged = b.stage(new, None, PauseBudget(0, 1))
    b.prepare(staged, new, (0,))

    def device_error(self, device):
        raise RuntimeError("simulated device error in the batch of disk writes")

    monkeypatch.setattr(_paddle.CheckedCopies, "run", device_error)

    class Host:  # the parts of a RankAgent that _swap_or_restore uses
        backend = b
        live_ranks = tuple(range(EP))
        log = None

    with pytest.raises(RuntimeError, match="simulated device error"):
        RankAgent._swap_or_restore(Host(), staged, new, None, (0,))
    monkeypatch.undo()
    assert not b.live.needs_reload
    assert np.array_equal(b.phy2log, OLD) and b.verify() == (L * 6, L * 6)
    b.prepare(staged, new, (0,))
    b.swap_layers(staged, new, (0,))  # the retry goes through
    assert np.array_equal(b.phy2log, new) and b.verify() == (L * 6, L * 6)


# ---- copy_rows_checked: inputs --------------------------------------------------------------------------------------
def test_a_batch_of_no_bytes_copies_nothing():
    import paddle

    t = paddle.zeros([4, 8], dtype="float32")
    assert _paddle.copy_rows_checked([R(t, 1, t, 2, 0)], "cpu") == []
    assert _paddle.copy_rows_checked([], "cpu") == []


@pytest.mark.parametrize("device_path", [False, True])
def test_rows_outside_a_tensor_or_of_another_shape_are_refused_on_both_paths(device_path, monkeypatch):
    """ValueError before anything is copied, on the host path and on the device path (a GPU's tensors; taken here
    for CPU tensors), which used to slice and so clamp the rows silently (QA)."""
    import paddle

    src = paddle.arange(32, dtype="float32").reshape([4, 8])
    dst = paddle.zeros([4, 8], dtype="float32")
    if device_path:
        monkeypatch.setattr(_paddle, "on_host", lambda t: False)
    with pytest.raises(ValueError, match="outside"):
        _paddle.copy_rows_checked([R(dst, 2, src, 2, 5)], "cpu")
    with pytest.raises(ValueError, match="outside"):
        _paddle.copy_rows_checked([R(dst, 0, src, -1, 2)], "cpu")
    with pytest.raises(ValueError, match="rows of float32"):
        _paddle.copy_rows_checked([R(dst, 0, paddle.zeros([4, 4], dtype="float32"), 0, 1)], "cpu")
    with pytest.raises(ValueError, match="rows of float16"):
        _paddle.copy_rows_checked([R(dst, 0, paddle.zeros([4, 8], dtype="float16"), 0, 1)], "cpu")
    assert not dst.numpy().any()


def test_copies_that_overlap_are_refused_before_anything_is_copied():
    """A copy whose source overlaps its own destination (forward block copies would read rows already written, and
    each block's compare would still pass), or that writes what another copy of the batch reads or writes."""
    import paddle

    t = paddle.arange(16 * 8, dtype="float32").reshape([16, 8])
    u = paddle.zeros([16, 8], dtype="float32")
    before = t.numpy().copy()
    for batch in ([R(t, 1, t, 0, 15)],  # itself
                  [R(u, 0, t, 0, 4), R(t, 2, u, 8, 4)],  # writes rows the first copy reads
                  [R(u, 0, t, 0, 4), R(u, 3, t, 8, 2)]):  # two copies write row 3
        with pytest.raises(ValueError, match="overlaps"):
            _paddle.copy_rows_checked(batch, "cpu")
    assert np.array_equal(t.numpy(), before) and not u.numpy().any()
    assert _paddle.copy_rows_checked([R(u, 0, t, 0, 4), R(u, 4, t, 0, 4)], "cpu") == []  # sources may be shared


#: the most any wait of the interrupt test lasts (a failed build ends with a message, not a hang)
_DEADLINE = 30


@pytest.mark.parametrize("point", ["waiting", "copying", "taking"])
def test_an_interrupt_while_the_batch_waits_for_its_threads_leaves_only_after_they_are_done(point, monkeypatch):
    """A KeyboardInterrupt (SIGINT, or an engine's signal handler that raises) while the calling thread waits for
    the other copy threads, copies (between two blocks of a piece) or has just taken a piece off a stretch is raised
    again only once they are done: nothing writes into the live tensors after copy_rows_checked has raised (QA: 25
    raw copies ran after it), and every byte was copied (a piece cut short used to be left half-written).

    Driven by events, not timers (a timer's interrupt landed in the test's own bookkeeping on a loaded machine):
    the calling thread's first copy waits until a pool thread is writing, and that pool thread's copy lasts until
    the calling thread, interrupted, has come back to wait for it."""
    if _paddle.copy_threads() < 2:
        pytest.skip("needs 2 copy threads (2 usable cores)")
    import paddle

    rows, width = 64, 64 * 1024  # 16 MiB of float32 rows: 64 blocks of 256 KiB, 16 pieces of 1 MiB
    src = paddle.arange(rows * width, dtype="float32").reshape([rows, width])
    dst = paddle.zeros([rows, width], dtype="float32")
    main = threading.main_thread()
    pool_writes, main_writes, in_flight = [], [], []  # raw copies done by each side; pool copies not yet done
    released_in_time = []  # the pool thread's held copy was let go by the event (not by its deadline)
    pool_writing, main_waiting, interrupted, released = (threading.Event() for _ in range(4))
    real_copy, real_wait, real_deque = _paddle._copy_bytes, _paddle.wait, _paddle.deque

    def copy(d, s, n):
        if threading.current_thread() is not main:
            in_flight.append(d)
            if not pool_writing.is_set():  # the pool thread's first copy lasts until the caller waits again
                pool_writing.set()
                if point == "waiting" and main_waiting.wait(_DEADLINE):
                    for _ in range(_DEADLINE * 20):  # a signal that comes just before the caller blocks is handled
                        signal.pthread_kill(main.ident, signal.SIGINT)  # only once it wakes: sent until taken
                        if interrupted.wait(0.05):
                            break
                released_in_time.append(released.wait(_DEADLINE))
            out = real_copy(d, s, n)
            pool_writes.append(d)
            in_flight.remove(d)
            return out
        assert pool_writing.wait(_DEADLINE), "no pool thread took part in the batch"
        out = real_copy(d, s, n)
        main_writes.append(d)
        if point == "copying" and len(main_writes) == 2:  # block 2 of the caller's first piece of 4
            signal.raise_signal(signal.SIGINT)
        return out

    def waiting(futures, *args, **kwargs):
        main_waiting.set()
        if interrupted.is_set():  # the interrupt has been taken: the pool thread may finish its copy
            released.set()
        return real_wait(futures, *args, **kwargs)

    class Stretch(real_deque):
        taken = 0

        def popleft(self):
            piece = super().popleft()
            if threading.current_thread() is main:
                Stretch.taken += 1
                if point == "taking" and Stretch.taken == 2:  # the piece is off its stretch, not yet held
                    signal.raise_signal(signal.SIGINT)
            return piece

    def handler(signum, frame):
        if not interrupted.is_set():  # the first signal interrupts; one more, sent before the first was taken, not
            interrupted.set()
            raise KeyboardInterrupt

    monkeypatch.setattr(_paddle, "_copy_bytes", copy)
    monkeypatch.setattr(_paddle, "wait", waiting)
    monkeypatch.setattr(_paddle, "deque", Stretch)
    previous = signal.signal(signal.SIGINT, handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            _paddle.copy_rows_checked([R(dst, 0, src, 0, rows)], "cpu")
        still_writing = list(in_flight)  # a wrong build raises while the pool thread is still held in its copy
    finally:
        signal.signal(signal.SIGINT, previous)
        released.set()
    assert interrupted.is_set(), "the interrupt did not arrive during the batch"
    assert not still_writing, "copy_rows_checked raised while a copy thread still wrote"
    assert pool_writes and main_writes
    assert released_in_time == [True], "the interrupted caller did not come back to wait for the copy threads"
    assert np.array_equal(dst.numpy(), src.numpy()), "the interrupt left the batch half-copied"


def test_a_chunk_is_applied_only_to_the_live_state_it_was_loaded_against(ckpt):
    """load_chunk checks the chunk against the live experts (as swap checks a whole swap) so the pause only compares
    identities: a reload, a change of the routed ranks or the chunk's own application since it was loaded is a
    WeightError in the pause, other rows of the new placement an InputError; nothing is written then, and loading
    the chunk again applies it."""
    b = backend(ckpt)
    staged = b.stage(NEW, None, PauseBudget(0, 1))
    before = snapshot_bytes(b.live)
    b.prepare(staged, NEW, (0,))
    b.reload()
    with pytest.raises(WeightError, match="changed since the chunk"):
        b.swap_layers(staged, NEW, (0,))
    b.prepare(staged, NEW, (0,))
    b.set_live_ranks(tuple(range(EP)))
    with pytest.raises(WeightError, match="changed since the chunk"):
        b.swap_layers(staged, NEW, (0,))
    b.prepare(staged, NEW, (0,))
    other = NEW.copy()
    other[0] = OLD[0]
    with pytest.raises(InputError, match="rows of layers"):
        b.swap_layers(staged, other, (0,))
    assert snapshot_bytes(b.live) == before and np.array_equal(b.phy2log, OLD) and not b.live.needs_reload
    b.swap_layers(staged, NEW, (0,))
    with pytest.raises(WeightError, match="load_chunk"):
        b.swap_layers(staged, NEW, (0,))  # applied once
    with pytest.raises(InputError, match="another placement"):
        b.prepare(staged, NEW, (0,))  # layer 0 is live on the new placement now: the plan no longer starts there
    for layers in chunk_layers(staged.starts, changed_layers(OLD, NEW))[1:]:
        b.prepare(staged, NEW, layers)
        b.swap_layers(staged, NEW, layers)
    assert np.array_equal(b.phy2log, NEW) and b.verify() == (L * 6, L * 6)
