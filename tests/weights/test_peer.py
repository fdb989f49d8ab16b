"""Peer-to-peer expert transfer: the plan's sources, the authenticated transport between real processes, and the
fallback to the checkpoint when a peer refuses, lies, stalls or dies mid-transfer."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
from multiprocessing.connection import Listener
from pathlib import Path

import numpy as np
import pytest

from fdeplb.errors import InputError, PeerAuthError, PeerTransferError
from fdeplb.placement.digest import routing_digest
from fdeplb.testing import NumpyWeights, expert_tensor
from fdeplb.weights import peer as peer_module
from fdeplb.weights.peer import PeerRequest, PeerServer, SocketTransport, peer_authkey
from fdeplb.weights.peer_plan import CHECKPOINT, peer_sources
from fdeplb.weights.peer_staging import PeerFetch
from fdeplb.weights.plan import plan_transfer
from tests.helpers import wait_for
from tests.weights.peer_proc import CLUSTER, EP_SIZE, NEW, OLD

ROOT = Path(__file__).resolve().parents[2]
SECRET = "peer-test-secret"
KEY = peer_authkey(SECRET, CLUSTER)


# ---- sources ------------------------------------------------------------------------------------------------------
def _random_pair(seed: int, layers=4, experts=16, slots=24):
    rng = np.random.default_rng(seed)
    def make():
        return np.stack([np.concatenate([rng.permutation(experts), rng.integers(0, experts, slots - experts)])
                         for _ in range(layers)])

    return make(), make()


@pytest.mark.parametrize("seed", range(5))
def test_sources_name_every_new_expert_once_and_only_live_holders(seed):
    old, new = _random_pair(seed)
    for rank in range(4):
        sources = peer_sources(old, new, rank, 4, range(4))
        assert list(sources) == list(plan_transfer(old, new, rank, 4).disk)
        for (layer, expert), peer in sources.items():
            assert peer != rank
            if peer == CHECKPOINT:  # no other rank holds it live
                assert all(expert not in old[layer, r * 6:(r + 1) * 6] for r in range(4) if r != rank)
            else:
                assert expert in old[layer, peer * 6:(peer + 1) * 6]
        assert sources == peer_sources(old, new, rank, 4, [3, 2, 1, 0, 1])  # deterministic, order-free members


def test_sources_spread_the_load_over_the_holders():
    # every expert is on ranks 1, 2 and 3; rank 0 needs 8 experts it does not hold: each holder serves a share
    old = np.array([[8, 9, 10, 11, 12, 13] + list(range(6)) + list(range(6)) + list(range(6))])
    new = np.array([list(range(6)) + [8, 9, 10, 11, 12, 13] + list(range(6)) + list(range(6))])
    served = np.bincount(list(peer_sources(old, new, 0, 4, range(4)).values()), minlength=4)
    assert served[0] == 0 and served[1:].sum() == 6 and served[1:].max() - served[1:].min() <= 1


def test_sources_skip_non_members_and_fall_back_to_the_checkpoint():
    sources = peer_sources(OLD, NEW, 0, EP_SIZE, [0, 1])  # rank 2 is not a member: only rank 1 serves
    assert set(sources.values()) <= {1, CHECKPOINT}
    assert all(e in OLD[layer, 4:8] for (layer, e), p in sources.items() if p == 1)
    assert set(peer_sources(OLD, NEW, 0, EP_SIZE, [0]).values()) == {CHECKPOINT}
    with pytest.raises(InputError, match="members"):
        peer_sources(OLD, NEW, 0, EP_SIZE, [5])


# ---- a peer in a process of its own -------------------------------------------------------------------------------
class Peer:
    """``tests.weights.peer_proc`` in a subprocess: its address, its output lines (read with deadlines)."""

    def __init__(self, mode: str = "ok", env: dict | None = None) -> None:
        full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.weights.peer_proc", SECRET, mode], cwd=ROOT,
                                     env=full, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.proc.stdout], daemon=True).start()
        self.address = self.wait_for("ADDR").split()[1]

    def wait_for(self, text: str, timeout_s: float = 60.0) -> str:
        while True:
            try:
                line = self.lines.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(f"peer printed no {text!r} within {timeout_s} s") from None
            if text in line:
                return line

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def peer():
    started: list[Peer] = []
    yield lambda *a, **k: started.append(Peer(*a, **k)) or started[-1]
    for p in started:
        p.stop()


def _into():
    buf = np.empty(NumpyWeights(OLD, 0, EP_SIZE).expert_size, np.float32)
    return buf, {"w": memoryview(buf).cast("B")}


def test_round_trip_between_two_processes(peer):
    p = peer("ok")
    transport = SocketTransport({1: p.address}, KEY, timeout_s=10)
    try:
        for layer, expert in ((0, 4), (0, 7), (1, 3)):
            buf, into = _into()
            transport.fetch(1, PeerRequest(layer, expert, routing_digest(OLD)), into)
            assert np.array_equal(buf, expert_tensor(layer, expert))
        with pytest.raises(PeerTransferError, match="holds no live slot of expert 0 in layer 0"):
            transport.fetch(1, PeerRequest(0, 0, routing_digest(OLD)), _into()[1])
        with pytest.raises(PeerTransferError, match="the request names"):
            transport.fetch(1, PeerRequest(0, 4, routing_digest(NEW)), _into()[1])
        buf, into = _into()  # a refusal leaves the connection usable
        transport.fetch(1, PeerRequest(0, 5, routing_digest(OLD)), into)
        assert np.array_equal(buf, expert_tensor(0, 5))
    finally:
        transport.close()


def test_one_batch_serves_some_experts_and_refuses_others_in_request_order(peer):
    p = peer("ok")
    transport = SocketTransport({1: p.address}, KEY, timeout_s=10)
    wanted = [(0, 4), (0, 0), (1, 3), (0, 5)]  # rank 1 holds no live slot of expert 0 in layer 0
    bufs, items = [], []
    for layer, expert in wanted:
        buf, into = _into()
        bufs.append(buf)
        items.append((PeerRequest(layer, expert, routing_digest(OLD)), into))
    arrived: list[int] = []
    try:
        got = transport.fetch_many(1, items, arrived.append)
        assert isinstance(got[1], PeerTransferError) and "no live slot of expert 0 in layer 0" in str(got[1])
        assert arrived == [0, 2, 3]
        for k in (0, 2, 3):
            assert np.array_equal(bufs[k], expert_tensor(*wanted[k]))
        buf, into = _into()  # the connection is still in step after the batch
        transport.fetch(1, PeerRequest(1, 2, routing_digest(OLD)), into)
        assert np.array_equal(buf, expert_tensor(1, 2))
    finally:
        transport.close()


def test_requests_are_cut_at_a_placement_change_the_expert_count_and_the_byte_bound():
    from fdeplb.weights.peer import BATCH_BYTES, BATCH_EXPERTS, _batches

    small = [(PeerRequest(0, e, "a"), 1) for e in range(BATCH_EXPERTS + 1)]
    assert [len(b) for _, b in _batches(small)] == [BATCH_EXPERTS, 1]
    mixed = [(PeerRequest(0, 0, "a"), 1), (PeerRequest(0, 1, "b"), 1), (PeerRequest(0, 2, "b"), 1)]
    assert [(p, len(b)) for p, b in _batches(mixed)] == [("a", 1), ("b", 2)]
    big = [(PeerRequest(0, e, "a"), BATCH_BYTES // 2 + 1) for e in range(3)]
    big.append((PeerRequest(0, 3, "a"), 2 * BATCH_BYTES))
    assert [len(b) for _, b in _batches(big)] == [1, 1, 1, 1]  # never two halves over the bound; a large one alone
    assert [r for _, b in _batches(big) for r in b] == [r for r, _ in big]


def test_a_request_of_too_many_experts_is_refused_whole(peer):
    from multiprocessing.connection import Client

    from fdeplb.weights.peer import BATCH_EXPERTS

    host, _, port = peer("ok").address.rpartition(":")
    with Client((host, int(port)), authkey=KEY) as conn:
        conn.send_bytes(json.dumps({"placement": routing_digest(OLD), "experts": [[0, 4]] * (BATCH_EXPERTS + 1)}
                                   ).encode())
        head = json.loads(conn.recv_bytes())
    assert head["ok"] is False and "bad request" in head["error"] and "answers" not in head


def test_a_wrong_authkey_is_refused_before_any_byte_moves(peer):
    p = peer("ok")
    transport = SocketTransport({1: p.address}, peer_authkey("not-the-secret", CLUSTER), timeout_s=10)
    buf, into = _into()
    buf[:] = 0
    with pytest.raises(PeerAuthError, match="AuthenticationError.*refused this rank.s key.*another FDEPLB_PEER_SECRET"):
        transport.fetch(1, PeerRequest(0, 4, routing_digest(OLD)), into)
    assert not buf.any()
    with pytest.raises(PeerTransferError, match="no registered peer address") as refused:
        transport.fetch(2, PeerRequest(0, 4, routing_digest(OLD)), into)
    assert not isinstance(refused.value, PeerAuthError)  # only a failed handshake names the secret
    with pytest.raises(InputError, match=r"secret \(FDEPLB_PEER_SECRET\)$"):
        peer_authkey("", CLUSTER)


def test_connections_past_the_handshake_cap_are_turned_away_and_the_server_serves_on(monkeypatch):
    monkeypatch.setattr(peer_module, "MAX_HANDSHAKES", 2)
    server = PeerServer(NumpyWeights(OLD, 1, EP_SIZE), KEY, timeout_s=10)
    host, _, port = server.address.rpartition(":")
    silent = [socket.create_connection((host, int(port)), timeout=10) for _ in range(2)]  # never authenticate
    try:
        extra = socket.create_connection((host, int(port)), timeout=10)
        with extra:
            assert extra.recv(1) == b""  # closed unserved: no challenge sent, no thread started
        assert server.turned_away == 1
        for s in silent:  # their handshakes fail: the server takes connections again
            s.close()

        def served() -> bool:
            transport = SocketTransport({1: server.address}, KEY, timeout_s=10)
            try:
                buf, into = _into()
                transport.fetch(1, PeerRequest(0, 4, routing_digest(OLD)), into)
                return np.array_equal(buf, expert_tensor(0, 4))
            except PeerTransferError:
                return False
            finally:
                transport.close()

        wait_for(served, 10, what="a peer served once the silent connections closed")
        assert server.turned_away >= 1
    finally:
        for s in silent:
            s.close()
        server.close()


@contextmanager
def fake_peer(then, timeout_s: float = 10, header: bytes = b'{"answers": [{"ok": true, "checksum": [1], '
              b'"sizes": [["w", 256]]}]}'):
    """A peer speaking the protocol by hand (the stdlib Listener, same key): it reads one request, answers
    ``header`` (by default one for a 256-byte expert), then ``then(conn)``; yields a transport to it."""
    listener = Listener(("127.0.0.1", 0), authkey=KEY)
    done = threading.Event()

    def serve():
        conn = listener.accept()
        conn.recv_bytes()
        conn.send_bytes(header)
        then(conn, done)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    host, port = listener.address
    transport = SocketTransport({1: f"{host}:{port}"}, KEY, timeout_s=timeout_s)
    try:
        yield transport
    finally:
        done.set()
        transport.close()
        t.join(10)
        listener.close()


def test_a_truncated_frame_is_an_error():
    def short(conn, _done):
        conn.send_bytes(b"x" * 100)
        with pytest.raises(EOFError):
            conn.recv_bytes()  # until the client hangs up

    with fake_peer(short) as transport:
        with pytest.raises(PeerTransferError, match="truncated frame"):
            transport.fetch(1, PeerRequest(0, 4, routing_digest(OLD)), _into()[1])


@pytest.mark.parametrize("field", ['"checksum": [Infinity], "sizes": [["w", 256]]',
                                   '"checksum": [1], "sizes": [["w", 1e999]]'])
def test_a_header_with_a_number_past_any_int_is_a_transfer_error_not_an_overflow(field):
    """JSON's Infinity (or 1e999) where the header has an int: int() raises OverflowError, which the transport
    let out of fetch(), so staging failed (LOAD_FAILED) instead of reading that expert from the checkpoint."""
    def send(conn, _done):
        conn.send_bytes(b"x" * 256)
        with pytest.raises(EOFError):
            conn.recv_bytes()  # until the client hangs up

    header = ('{"answers": [{"ok": true, ' + field + '}]}').encode()
    with fake_peer(send, header=header) as transport:
        with pytest.raises(PeerTransferError, match="OverflowError"):
            transport.fetch(1, PeerRequest(0, 4, routing_digest(OLD)), _into()[1])


def test_a_request_with_a_number_past_any_int_is_refused_and_the_connection_serves_on():
    """The server side of the same: the serving thread died of the OverflowError (a traceback, the connection
    cut) instead of refusing the request as bad."""
    from multiprocessing.connection import Client

    server = PeerServer(NumpyWeights(OLD, 1, EP_SIZE), KEY)
    host, _, port = server.address.rpartition(":")
    conn = Client((host, int(port)), authkey=KEY)
    try:
        conn.send_bytes(b'{"placement": "x", "experts": [[Infinity, 4]]}')
        assert conn.poll(10)
        assert json.loads(conn.recv_bytes())["error"] == "bad request: cannot convert float infinity to integer"
        conn.send_bytes(json.dumps({"placement": routing_digest(OLD), "experts": [[0, 4]]}).encode())
        assert conn.poll(10) and json.loads(conn.recv_bytes())["answers"][0]["ok"] is True
    finally:
        conn.close()
        server.close()


def test_a_peer_slow_on_every_expert_but_within_each_deadline_is_cut_at_its_share_budget():
    """A peer that delivers each expert inside the per-expert wait but its whole share far past it (here 8 x 0.3 s
    against a 1 s wait) was waited on to the end (N x the wait: past the loading deadline, the round aborted);
    with ``total_s`` the items past it fail and are read from the checkpoint."""
    n = 8
    listener = Listener(("127.0.0.1", 0), authkey=KEY)
    done = threading.Event()

    def serve():
        conn = listener.accept()
        conn.recv_bytes()
        conn.send_bytes(json.dumps({"answers": [{"ok": True, "checksum": [1], "sizes": [["w", 256]]}] * n}).encode())
        try:
            for _ in range(n):
                if done.wait(0.3):  # the peer's pace: each expert well within the 1 s wait
                    return
                conn.send_bytes(b"x" * 256)
            conn.recv_bytes()
        except (EOFError, OSError):
            pass  # cut by the receiver

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    host, port = listener.address
    transport = SocketTransport({1: f"{host}:{port}"}, KEY, timeout_s=1.0, total_s=1.0)
    try:
        out = transport.fetch_many(1, [(PeerRequest(0, e, "d"), {"w": bytearray(256)}) for e in range(n)])
    finally:
        done.set()
        transport.close()
        t.join(10)
        listener.close()
    failed = [i for i, o in enumerate(out) if isinstance(o, PeerTransferError)]
    assert failed and failed == list(range(failed[0], n))  # 8 x 0.3 s > 1 s: the share cannot all arrive
    assert all(o == (1,) for o in out[:failed[0]])
    assert all("longer than 1 s" in str(out[i]) for i in failed)


def test_a_stalled_peer_is_cut_at_its_deadline():
    with fake_peer(lambda _conn, done: done.wait(30), timeout_s=0.5) as transport:  # never sends the bytes
        with pytest.raises(PeerTransferError, match="did not deliver"):
            transport.fetch(1, PeerRequest(0, 4, routing_digest(OLD)), _into()[1])


# ---- staging with fallbacks ---------------------------------------------------------------------------------------
def _stage(addresses: dict[int, str], timeout_s: float = 10):
    receiver = NumpyWeights(OLD, 0, EP_SIZE)
    transport = SocketTransport(addresses, KEY, timeout_s=timeout_s)
    sources = peer_sources(OLD, NEW, 0, EP_SIZE, range(EP_SIZE))
    sources = {k: (1 if p != CHECKPOINT else p) for k, p in sources.items()}  # rank 1 serves all it is asked
    try:
        staged = receiver.stage(NEW, None, peers=PeerFetch(transport, sources, routing_digest(OLD)))
    finally:
        transport.close()
    return receiver, staged


def _swapped_and_verified(receiver, staged):
    receiver.swap(staged, NEW)
    assert receiver.verify() == (8, 8)


def test_staging_takes_every_new_expert_from_a_live_peer(peer):
    receiver, staged = _stage({1: peer("ok").address})
    assert staged.fallbacks == []
    assert staged.report.disk == 0 and staged.report.disk_bytes == 0
    assert staged.report.peer == 8 and staged.report.peer_bytes == 8 * receiver.expert_nbytes
    _swapped_and_verified(receiver, staged)


def test_a_peer_sending_wrong_bytes_falls_back_to_the_checkpoint(peer):
    receiver, staged = _stage({1: peer("wrong").address})
    assert staged.report.peer == 0 and staged.report.disk == 8
    assert len(staged.fallbacks) == 8
    assert all("wrong bytes" in f.error for f in staged.fallbacks)  # each checked on its own
    _swapped_and_verified(receiver, staged)  # nothing half-staged: every slot holds its expert


@pytest.mark.slow
@pytest.mark.faults
def test_a_peer_sigkilled_mid_transfer_falls_back_to_the_checkpoint(peer):
    p = peer("ok", env={"FDEPLB_FAILPOINTS": "peer.hang=sending"})
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(result=_stage({1: p.address}, timeout_s=60)), daemon=True)
    t.start()
    p.wait_for("failpoint hit")  # its header is sent, its bytes are not
    p.proc.send_signal(signal.SIGKILL)
    t.join(60)
    assert not t.is_alive()
    receiver, staged = out["result"]
    assert staged.report.peer == 0 and staged.report.disk == 8
    assert "did not deliver" in staged.fallbacks[0].error
    _swapped_and_verified(receiver, staged)


def test_a_request_that_stops_mid_frame_is_cut_at_the_servers_deadline():
    """A receiver that stalls halfway through sending its request (stopped, partitioned) held a serving thread in
    recv for good: the request is read under the server's deadline too, then the connection is closed."""
    from multiprocessing.connection import Client

    server = PeerServer(NumpyWeights(OLD, 1, EP_SIZE), KEY, timeout_s=0.5)
    host, _, port = server.address.rpartition(":")
    conn = Client((host, int(port)), authkey=KEY)
    try:
        os.write(conn.fileno(), b"\x00\x00\x00\x40{")  # a 64-byte frame's length and its first byte only
        assert conn.poll(10), "the server never hung up"
        with pytest.raises(EOFError):
            conn.recv_bytes()
    finally:
        conn.close()
        server.close()


def test_a_closed_server_refuses_connections_at_once():
    """close() shuts the listening socket down: closing it alone left the port accepting connections while the
    accepting thread sat in accept() (up to its 0.5 s timeout)."""
    server = PeerServer(NumpyWeights(OLD, 1, EP_SIZE), KEY)
    host, _, port = server.address.rpartition(":")
    from multiprocessing.connection import Client

    Client((host, int(port)), authkey=KEY).close()  # served: the accepting thread is back in accept()
    server.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=5).close()


def test_a_server_refuses_an_authkey_too_short():
    with pytest.raises(InputError, match="16 bytes"):
        PeerServer(NumpyWeights(OLD, 1, EP_SIZE), b"short")


@pytest.mark.slow
@pytest.mark.faults
def test_a_clear_while_a_host_slot_is_being_sent_neither_crashes_nor_sends_freed_memory(tmp_path):
    """Real process (a crash is the failure): the clear cuts the peer transfer that reads the slots' memory and
    frees it only once that send let go."""
    out = subprocess.run([sys.executable, "-m", "tests.weights.clear_while_serving", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    said = out.stdout + out.stderr
    assert out.returncode == 0 and "\nOK " in "\n" + out.stdout, said[-3000:]
    assert "Bad address" not in said, said[-3000:]  # the send read memory the clear had freed (EFAULT)
