"""Chunked swaps on real paddle tensors: chunk layouts within a pause budget, the device buffer, the on-device check
of every written slot (never a read-back of the experts) and the routing rows that switch with their layer."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytest.importorskip("paddle")

from fdeplb.errors import StagingBudgetError, VerificationError  # noqa: E402
from fdeplb.weights import CheckpointBackend, routing_tables  # noqa: E402
from fdeplb.weights import _paddle  # noqa: E402
from fdeplb.weights.plan import PauseBudget, changed_layers, chunk_layers, chunk_starts, plan_transfer  # noqa: E402
from tests.weights.helpers import EP, NEW, OLD, snapshot_bytes  # noqa: E402

L = OLD.shape[0]


def backend(ckpt_dir) -> CheckpointBackend:
    return CheckpointBackend.open({"path": str(ckpt_dir)}, OLD, 0, EP, device="cpu")


def apply_all(b: CheckpointBackend, staged, new, chunks) -> list:
    reports = []
    for layers in chunks:
        b.prepare(staged, new, layers)
        reports.append(b.swap_layers(staged, new, layers))
    return reports


# ---- layouts (pure numpy) ------------------------------------------------------------------------------------------
def test_chunk_layout_boundaries_first_last_unchanged_and_a_budget_smaller_than_one_layer():
    changed = np.array([0, 2, 3, 5], dtype=np.int64)  # layers 1 and 4 unchanged everywhere
    nbytes = np.array([10, 0, 0, 30, 0, 20], dtype=np.int64)  # layer 2 changes only on other ranks: 0 bytes here
    assert chunk_starts(changed, nbytes, PauseBudget(0, 0)) == (0,)  # no limit: one safe point
    assert chunk_starts(changed, nbytes, PauseBudget(40, 0)) == (0, 5)  # 10+0+30 fit, 20 starts the last
    assert chunk_starts(changed, nbytes, PauseBudget(0, 1)) == (0, 2, 3, 5)  # one changed layer per safe point
    assert chunk_starts(changed, nbytes, PauseBudget(5, 0)) == (0, 3, 5)  # smaller than a layer: it is one chunk,
    # and the 0-byte layer 2 joins the chunk of layer 0 (it costs this rank nothing)
    assert chunk_layers((0, 3, 5), changed) == [(0, 2), (3,), (5,)]  # unchanged layers 1, 4 are in no chunk
    # the union of two ranks' layouts is their common refinement; a chunk with no changed layer is dropped
    assert chunk_layers((0, 1, 3, 4, 5), changed) == [(0,), (2,), (3,), (5,)]
    assert chunk_starts(np.array([], dtype=np.int64), nbytes, PauseBudget(5, 1)) == ()


def test_a_chunked_swap_ends_where_the_whole_swap_ends_each_layer_switching_with_its_routing_rows(ckpt):
    """First chunk, last chunk, and an unchanged layer: after each chunk, exactly that chunk's layers route (and
    hold weights) by the new placement, every other layer by the old one; the end state is the whole swap's."""
    whole = backend(ckpt)
    whole.swap(whole.stage(NEW, None), NEW)
    b = backend(ckpt)
    per_layer = b.live.expert_nbytes * 6  # budget of one full layer of rank 0's six slots
    staged = b.stage(NEW, None, PauseBudget(per_layer, 0))
    changed = changed_layers(OLD, NEW)
    assert changed.tolist() == [0, 2]  # layer 1 is unchanged: it is in no chunk
    chunks = chunk_layers(staged.starts, changed)
    assert chunks == [(0,), (2,)]
    assert staged.experts.buffer is not None and staged.experts.buffer.capacity == 1  # the largest chunk: 7 (layer 0)
    old_l2p, old_cnt = routing_tables(OLD, 8, b.live.max_replicas)
    new_l2p, new_cnt = routing_tables(NEW, 8, b.live.max_replicas)
    for k, layers in enumerate(chunks):
        b.prepare(staged, NEW, layers)
        report = b.swap_layers(staged, NEW, layers)
        assert report.slots_verified > 0
        done = {layer for c in chunks[: k + 1] for layer in c}
        for layer in range(L):
            want = NEW if layer in done else OLD
            assert np.array_equal(b.live.phy2log_tensor.numpy()[layer], want[layer])
            assert np.array_equal(b.live.log2phy.numpy()[layer], (new_l2p if layer in done else old_l2p)[layer])
            assert np.array_equal(b.live.logcnt.numpy()[layer], (new_cnt if layer in done else old_cnt)[layer])
    assert np.array_equal(b.phy2log, NEW)
    assert snapshot_bytes(b.live) == snapshot_bytes(whole.live)
    assert b.verify() == (L * 6, L * 6)


def test_a_layer_unchanged_on_this_rank_costs_no_copy_only_its_routing_rows(ckpt):
    new = NEW.copy()
    new[1] = [0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 1, 3]  # layer 1 changes only on rank 1's slots
    b = backend(ckpt)
    staged = b.stage(new, None, PauseBudget(0, 1))
    chunks = chunk_layers(staged.starts, changed_layers(OLD, new))
    assert chunks == [(0,), (1,), (2,)]
    before = snapshot_bytes(b.live)
    b.prepare(staged, new, (1,))
    report = b.swap_layers(staged, new, (1,))
    assert report.slots_verified == 0 and report.bytes_from_staging == report.bytes_local == 0
    assert snapshot_bytes(b.live) == before  # no slot written
    assert np.array_equal(b.live.log2phy.numpy()[1], routing_tables(new, 8, b.live.max_replicas)[0][1])


def test_the_device_buffer_counts_in_the_staging_budget_up_front(ckpt):
    b = backend(ckpt)
    plan = plan_transfer(OLD, NEW, 0, EP)
    host = len(plan.disk) * b.reader.expert_nbytes
    b.stage(NEW, host, None).release()  # the whole swap at once: host staging only
    with pytest.raises(StagingBudgetError, match="device buffer"):
        b.stage(NEW, host, PauseBudget(0, 0))  # one chunk of everything: a device buffer of every disk expert
    staged = b.stage(NEW, host + b.reader.expert_nbytes, PauseBudget(0, 1))  # chunks of one layer: 1 expert
    assert staged.experts.buffer.nbytes == b.reader.expert_nbytes
    staged.release()


def short_copy_once(monkeypatch):
    """Make the next raw host copy land one byte short, that byte wrong (the copy primitive itself fails, the real
    comparison after it must find it); returns the list of (dst, n) copies it saw."""
    real, seen = _paddle._copy_bytes, []

    def copy(dst, src, n):
        seen.append((dst, n))
        out = real(dst, src, n - 1 if len(seen) == 1 else n)
        if len(seen) == 1:  # the byte left behind is made wrong (it could equal the right one by chance)
            ctypes.c_ubyte.from_address(dst + n - 1).value = ctypes.c_ubyte.from_address(src + n - 1).value ^ 0x40
        return out

    monkeypatch.setattr(_paddle, "_copy_bytes", copy)
    return seen


def test_a_mismatch_found_on_the_device_raises_and_keeps_that_layers_routing(ckpt, monkeypatch):
    """A slot written wrong in chunk 2 (the copy lands a byte short): found by the on-device comparison, with no
    expert read back to the host (a checksum during the pause would fail the test); chunk 1 stays applied, chunk 2's
    layers keep the old routing rows, and reload() restores a consistent rank."""
    b = backend(ckpt)
    staged = b.stage(NEW, None, PauseBudget(0, 1))
    b.prepare(staged, NEW, (0,))
    b.swap_layers(staged, NEW, (0,))
    b.prepare(staged, NEW, (2,))

    def no_readback(*_a, **_k):
        raise AssertionError("an expert was checksummed (read back) during the pause")

    seen = short_copy_once(monkeypatch)
    monkeypatch.setattr(_paddle, "checksum", no_readback)
    with pytest.raises(VerificationError, match="on the device"):
        b.swap_layers(staged, NEW, (2,))
    monkeypatch.undo()
    assert seen  # the pause copied through the checked host copy
    assert b.live.needs_reload
    p2l = b.live.phy2log_tensor.numpy()
    assert np.array_equal(p2l[0], NEW[0]) and np.array_equal(p2l[2], OLD[2])  # chunk 1 applied, chunk 2 not
    assert np.array_equal(b.live.logcnt.numpy()[2], routing_tables(OLD, 8, b.live.max_replicas)[1][2])
    b.reload()
    assert b.verify() == (L * 6, L * 6)


def test_copy_checked_compares_the_bytes_on_the_device_path_too():
    """The device path (equal_all of raw words, used on a GPU) on CPU tensors: equal, then one bit off."""
    import paddle

    a = paddle.randn([4, 6]).astype("bfloat16")
    b = paddle.zeros([4, 6], dtype="bfloat16")
    _paddle.copy_into(b, a)
    assert _paddle.all_checked([_paddle.device_equal(b, a)], "cpu") == []
    raw = _paddle.host_buffer(b)
    raw[3] ^= 0x01
    assert _paddle.all_checked([_paddle.device_equal(b, a), _paddle.device_equal(a, a)], "cpu") == [0]
    assert _paddle.copy_checked(b, a) is True and _paddle.host_buffer(b) == _paddle.host_buffer(a)


def test_a_batch_of_row_copies_lands_every_byte_and_names_the_one_that_did_not(monkeypatch):
    """copy_rows_checked on host tensors: rows land where asked (nothing else touched), a large batch is spread over
    several threads, and a copy short by one byte in a later stretch is the one index reported."""
    import threading

    import paddle

    rows, width = 64, 64 * 1024  # 64 rows of 256 KiB (float32): 16 MiB, enough for every copy thread
    src = paddle.arange(rows * width, dtype="float32").reshape([rows, width])
    dst = paddle.zeros([rows, width], dtype="float32")
    copies = [_paddle.RowCopy(dst, 0, src, 8, 8), _paddle.RowCopy(dst, 16, src, 0, 8),
              _paddle.RowCopy(dst, 40, src, 40, 24)]
    threads: set[str] = set()
    real = _paddle._copy_bytes
    # with work stealing the calling thread may copy everything before a pool thread wakes (a busy machine): the
    # caller's first piece waits (with a deadline) until a pool thread has copied, so the spread is what is tested
    spread = threading.Event()

    def copy(d, s, n):
        threads.add(threading.current_thread().name)
        if threading.current_thread() is threading.main_thread():
            spread.wait(30 if _paddle.copy_threads() > 1 else 0)
        else:
            spread.set()
        last = dst.data_ptr() + rows * width * 4
        return real(d, s, n - 1 if d + n == last else n)  # the last row of the last copy lands a byte short

    monkeypatch.setattr(_paddle, "_copy_bytes", copy)
    assert _paddle.copy_rows_checked(copies, "cpu") == [2]
    got, want = dst.numpy(), src.numpy()
    assert np.array_equal(got[0:8], want[8:16]) and np.array_equal(got[16:24], want[0:8])
    assert not got[8:16].any() and not got[24:40].any()  # rows no copy names stay as they were
    assert np.array_equal(got[40:63], want[40:63])
    assert len(threads) >= 2 if _paddle.copy_threads() > 1 else len(threads) == 1
    monkeypatch.undo()
    assert _paddle.copy_rows_checked(copies, "cpu") == []
    with pytest.raises(ValueError, match="outside"):
        _paddle.copy_rows_checked([_paddle.RowCopy(dst, 60, src, 0, 8)], "cpu")


def test_a_copy_thread_that_is_held_up_leaves_the_rest_of_its_stretch_to_the_others(monkeypatch):
    """Work stealing: the other copy thread's first raw copy is held (once it has taken its first piece) until the
    calling thread has copied everything but that piece (the calling thread's own stretch, then the back of the other's). A static split
    would wait for the held thread's whole stretch; the event is then set by the calling thread, not by its 10 s
    deadline, and the held thread wrote only the piece it had taken."""
    if _paddle.copy_threads() != 2:
        pytest.skip("needs exactly 2 copy threads (2 usable cores)")
    import threading

    import paddle

    rows, width = 64, 64 * 1024  # 64 blocks of 256 KiB, 16 pieces: 8 per thread
    src = paddle.arange(rows * width, dtype="float32").reshape([rows, width])
    dst = paddle.zeros([rows, width], dtype="float32")
    real, main = _paddle._copy_bytes, threading.main_thread()
    per_piece = _paddle._PIECE // _paddle._CHECK_BLOCK
    started, release, by_main, by_other = threading.Event(), threading.Event(), [], []

    def copy(d, s, n):
        if threading.current_thread() is main:
            assert by_main or started.wait(10), "the other copy thread never started"
            by_main.append(d)
            if len(by_main) == rows - per_piece:
                release.set()
        else:
            started.set()  # it holds its first piece
            assert release.wait(10), "the calling thread never took the held thread's pieces"
            by_other.append(d)
        return real(d, s, n)

    monkeypatch.setattr(_paddle, "_copy_bytes", copy)
    assert _paddle.copy_rows_checked([_paddle.RowCopy(dst, 0, src, 0, rows)], "cpu") == []
    assert release.is_set() and len(by_other) == per_piece and len(by_main) == rows - per_piece
    assert min(by_other) == dst.data_ptr() + (rows // 2) * width * 4  # the held thread's stretch: the second half
    assert np.array_equal(dst.numpy(), src.numpy())


def test_the_device_path_of_a_batch_copies_rows_and_compares_on_the_device(monkeypatch):
    """With the tensors taken for device tensors (the GPU path, on CPU tensors): each copy is a copy_ of the row
    slices plus an equal_all, one flag vector read back."""
    import paddle

    src = paddle.arange(6 * 10, dtype="float32").reshape([6, 10])
    dst = paddle.zeros([6, 10], dtype="float32")
    monkeypatch.setattr(_paddle, "on_host", lambda t: False)
    assert _paddle.copy_rows_checked([_paddle.RowCopy(dst, 1, src, 3, 2)], "cpu") == []
    assert np.array_equal(dst.numpy()[1:3], src.numpy()[3:5]) and not dst.numpy()[[0, 3, 4, 5]].any()


def test_a_run_of_slots_is_one_check_and_a_mismatch_in_it_names_its_slot(ckpt, monkeypatch):
    """Disk writes into consecutive slots from consecutive buffer entries are copied and checked as one run; a byte
    wrong in the run's second slot fails the run, and the error names exactly that slot (compared again slot by
    slot on the device)."""
    new = OLD.copy()
    new[1, :2] = [7, 6]  # rank 0's slots 0 and 1 of layer 1 (experts 0, 1 before): two new experts from disk
    b = backend(ckpt)
    staged = b.stage(new, None, PauseBudget(0, 1))
    b.prepare(staged, new, (1,))
    real_run, real_copy, runs = _paddle.CheckedCopies.run, _paddle._copy_bytes, []
    first_suffix = next(iter(b.live.tensors))
    target = b.live.slot(1, 1)[first_suffix].data_ptr()  # first byte of slot 1, layer 1

    def batch(self, device):
        runs.extend(c.rows for c in self.copies)
        return real_run(self, device)

    def copy(d, s, n):
        out = real_copy(d, s, n)
        if d <= target < d + n:
            ctypes.c_char.from_address(target).value = bytes([ctypes.c_char.from_address(target).value[0] ^ 0xFF])
        return out

    monkeypatch.setattr(_paddle.CheckedCopies, "run", batch)
    monkeypatch.setattr(_paddle, "_copy_bytes", copy)
    with pytest.raises(VerificationError, match=r": 1 swapped slot\(s\) differ on the device .*\[\(1, 1, 6\)\]"):
        b.swap_layers(staged, new, (1,))
    assert runs == [2, 2]  # one copy per suffix for both slots


def test_a_chunked_swap_with_only_local_copies_needs_no_device_buffer(ckpt):
    """A rank whose chunks read nothing from disk (its slots exchange experts it already holds) is staged without
    a device buffer; every chunk still loads and applies (found in examples/serving_node.py: such a rank failed
    every chunk with 'no device buffer' and switched late)."""
    new = OLD.copy()
    new[0, :2] = [1, 0]  # rank 0 swaps the experts of its slots 0 and 1 in layer 0
    new[2, 2] = 0  # and copies expert 0 (its slot 0) into slot 2 of layer 2 (expert 2 stays on rank 1)
    b = backend(ckpt)
    staged = b.stage(new, None, PauseBudget(0, 1))
    assert staged.experts.buffer is None and not staged.transfer.disk
    reports = apply_all(b, staged, new, chunk_layers(staged.starts, changed_layers(OLD, new)))
    assert [r.local for r in reports] == [2, 1] and all(r.disk_slots == 0 for r in reports)
    assert np.array_equal(b.phy2log, new)
    assert b.verify() == (L * 6, L * 6)
