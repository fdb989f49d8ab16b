"""A peer server answers at most ``max_serving`` requests at once (QA of the serving hot path, item 4): each holds
up to 64 MiB of host copies, so many authenticated receivers cannot drive a popular peer out of host memory. A
request past the bound waits for a turn, then is refused whole with ``peer busy`` (the receiver's staging reads
those experts from the checkpoint). In-process server, a numpy source whose serving is held on an event."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import structlog.testing

from fdeplb.errors import InputError, PeerTransferError
from fdeplb.placement.digest import routing_digest
from fdeplb.testing import NumpyWeights, expert_tensor
from fdeplb.weights.peer import MAX_SERVING, PeerRequest, PeerServer, SocketTransport, peer_authkey
from tests.helpers import wait_for
from tests.weights.peer_proc import CLUSTER, EP_SIZE, OLD

KEY = peer_authkey("peer-test-secret", CLUSTER)
DIGEST = routing_digest(OLD)


class HeldSource:
    """Rank 1 of OLD; ``serve_expert`` (where a device slot's host copy is made) counts the requests inside it
    and, while ``hold`` is clear, waits on it."""

    def __init__(self) -> None:
        self.backend = NumpyWeights(OLD, 1, EP_SIZE)
        self.hold = threading.Event()
        self.inside = threading.Semaphore(0)  # released once per expert entering serve_expert
        self.lock = threading.Lock()
        self.now = self.peak = 0

    def serve_expert(self, layer: int, expert: int, placement: str):
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        self.inside.release()
        try:
            assert self.hold.wait(30), "never let go"
            return self.backend.serve_expert(layer, expert, placement)
        finally:
            with self.lock:
                self.now -= 1


def _fetch(address: str, expert: int, timeout_s: float = 10) -> np.ndarray | PeerTransferError:
    transport = SocketTransport({1: address}, KEY, timeout_s=timeout_s)
    buf = np.empty(NumpyWeights(OLD, 0, EP_SIZE).expert_size, np.float32)
    try:
        transport.fetch(1, PeerRequest(0, expert, DIGEST), {"w": memoryview(buf).cast("B")})
        return buf
    except PeerTransferError as err:
        return err
    finally:
        transport.close()


def test_a_request_past_max_serving_is_refused_as_busy_and_served_once_a_turn_is_free():
    source = HeldSource()
    server = PeerServer(source, KEY, timeout_s=0.4, max_serving=1)  # a busy request waits 0.2 s
    results: dict[int, object] = {}
    first = threading.Thread(target=lambda: results.setdefault(4, _fetch(server.address, 4)))
    try:
        first.start()
        assert source.inside.acquire(timeout=10)  # the first request holds the one turn
        with structlog.testing.capture_logs() as logs:
            busy = _fetch(server.address, 5)
        assert isinstance(busy, PeerTransferError) and "peer busy: 1 requests are being answered" in str(busy)
        assert server.busy == 1 and server.refused == 1
        assert [e for e in logs if e["event"] == "peer request refused" and "max_serving" in e["reason"]]
        source.hold.set()
        first.join(10)
        assert np.array_equal(results[4], expert_tensor(0, 4))
        again = _fetch(server.address, 5)  # the turn is free again
        assert np.array_equal(again, expert_tensor(0, 5))
        assert server.busy == 1 and server.served == 2
    finally:
        source.hold.set()
        server.close()


def test_many_receivers_at_once_are_answered_within_the_bound_and_all_served():
    """Six receivers, max_serving=2: at most two requests are ever inside serve_expert (where host copies are
    made); the others wait their turn (a wait long enough for all) and every one is served."""
    source = HeldSource()
    server = PeerServer(source, KEY, timeout_s=20, max_serving=2)
    results: dict[int, object] = {}
    experts = [4, 5, 6, 7, 4, 5]
    threads = [threading.Thread(target=lambda i=i, e=e: results.setdefault(i, _fetch(server.address, e, 30)))
               for i, e in enumerate(experts)]
    try:
        turns, asked = server._serving, []

        class Counted:  # the server's turns, counting the requests that asked for one
            def acquire(self, *a, **k):
                asked.append(1)
                return turns.acquire(*a, **k)

            def release(self):
                turns.release()

        server._serving = Counted()
        for t in threads:
            t.start()
        wait_for(lambda: len(asked) == len(experts), 10, what="every request at the server")
        for _ in range(2):
            assert source.inside.acquire(timeout=10)
        assert source.now == 2  # six asked, two let in: the others wait for a turn
        source.hold.set()
        for t in threads:
            t.join(30)
        assert source.peak == 2
        assert all(np.array_equal(results[i], expert_tensor(0, e)) for i, e in enumerate(experts))
        assert server.busy == 0
    finally:
        source.hold.set()
        server.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, "4", True, None])
def test_max_serving_must_be_an_int_of_at_least_one(bad):
    with pytest.raises(InputError, match="max_serving must be an int >= 1"):
        PeerServer(HeldSource(), KEY, max_serving=bad)


def test_the_default_bound():
    server = PeerServer(HeldSource(), KEY)
    try:
        assert server.max_serving == MAX_SERVING == 4
    finally:
        server.close()
