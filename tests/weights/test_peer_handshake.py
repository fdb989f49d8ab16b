"""What a failed peer handshake tells, and no more (QA of the serving hot path, item 5): a foreign server speaking
multiprocessing framing at a peer's registered address is not called "a peer whose secret likely differs". Each
server here is the standard library's, by hand, in a thread; the alarm is checked on a PeerService with stand-ins
for its backend and store."""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from multiprocessing import AuthenticationError
from multiprocessing.connection import CHALLENGE, WELCOME, Listener
from types import SimpleNamespace

import numpy as np
import pytest

from fdeplb.errors import PeerAuthError
from fdeplb.orchestration.peer_agent import PeerService
from fdeplb.placement.digest import routing_digest
from fdeplb.testing import NumpyWeights
from fdeplb.weights.peer import PeerRequest, SocketTransport, peer_authkey
from fdeplb.weights.peer_staging import Fallback
from tests.weights.peer_proc import CLUSTER, EP_SIZE, OLD

KEY = peer_authkey("peer-test-secret", CLUSTER)


@contextmanager
def server(behave, authkey=None):
    """A stdlib Listener (``authkey``: its handshake; None: none) whose one connection ``behave(conn)`` handles."""
    listener = Listener(("127.0.0.1", 0), authkey=authkey)

    def serve():
        try:
            conn = listener.accept()
        except (AuthenticationError, OSError, EOFError):
            return  # its own handshake refused ours
        try:
            behave(conn)
        except (OSError, EOFError):
            pass
        finally:
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    host, port = listener.address
    try:
        yield f"{host}:{port}"
    finally:
        t.join(10)
        listener.close()


def _fetch(address: str) -> PeerAuthError:
    transport = SocketTransport({1: address}, KEY, timeout_s=10)
    buf = np.empty(NumpyWeights(OLD, 0, EP_SIZE).expert_size, np.float32)
    try:
        with pytest.raises(PeerAuthError) as err:
            transport.fetch(1, PeerRequest(0, 4, routing_digest(OLD)), {"w": memoryview(buf).cast("B")})
        return err.value
    finally:
        transport.close()


def test_a_server_with_another_key_is_another_key_or_not_an_fdeplb_peer():
    with server(lambda conn: None, authkey=b"another program's key") as address:
        err = _fetch(address)
    assert f"the server at {address} refused this rank's key" in str(err)
    assert "another FDEPLB_PEER_SECRET or cluster id" in err.handshake and "not an fdeplb peer" in err.handshake
    assert "likely" not in str(err)


def test_a_foreign_server_that_sends_no_challenge_is_not_an_fdeplb_peer():
    """Framed bytes that are no challenge: Python 3.11's answer_challenge asserts (an AssertionError, not caught
    before): now an authentication failure saying what it is."""
    with server(lambda conn: conn.send_bytes(b"hello from another program")) as address:
        err = _fetch(address)
    assert f"the server at {address} sent no authentication challenge" in err.handshake
    assert "not an fdeplb peer" in err.handshake and "SECRET" not in err.handshake


def test_a_server_that_welcomes_any_key_but_fails_the_challenge_is_not_an_fdeplb_peer():
    def welcome_anything(conn):
        conn.send_bytes(CHALLENGE + os.urandom(20))
        conn.recv_bytes(256)
        conn.send_bytes(WELCOME)
        conn.recv_bytes(256)  # this rank's challenge
        conn.send_bytes(b"x" * 16)  # not its digest
        conn.recv_bytes(256)

    with server(welcome_anything) as address:
        err = _fetch(address)
    assert f"the server at {address} took this rank's key but failed its challenge" in err.handshake
    assert "SECRET" not in err.handshake


def test_the_alarm_says_what_each_failed_handshake_tells():
    class Store:
        def __init__(self):
            self.events, self.alarms = [], []

        def emit_event(self, kind, **fields):
            self.events.append(fields["message"])

        def append_alarm(self, cluster, *, actor, reason):
            self.alarms.append(reason)

        def read_cluster(self):
            return None

    foreign = "the server at 127.0.0.1:9 sent no authentication challenge (x): not an fdeplb peer (...)"
    other_key = "the server at 127.0.0.1:8 refused this rank's key: it holds another one (...)"
    fallbacks = [Fallback(0, 4, 2, "rank 2 ... " + foreign, True, foreign),
                 Fallback(0, 5, 2, "rank 2 failed earlier", True, foreign),
                 Fallback(0, 6, 1, "rank 1 ... " + other_key, True, other_key),
                 Fallback(0, 7, 3, "rank 3 refused expert 7: not live", False)]
    backend = SimpleNamespace(phy2log=OLD, stage=lambda *a, **k: SimpleNamespace(fallbacks=fallbacks))
    service = PeerService(NumpyWeights(OLD, 0, EP_SIZE), "peer-test-secret", CLUSTER, 0, EP_SIZE)
    try:
        service.fetch_for = lambda *a: SimpleNamespace(transport=SimpleNamespace(close=lambda: None))
        store = Store()
        service.stage(backend, OLD, None, None, (0, 1, 2, 3), store)
        service.stage(backend, OLD, None, None, (0, 1, 2, 3), store)  # once per service
    finally:
        service.close()
    assert len(store.alarms) == 1 and store.events == store.alarms
    assert store.alarms[0] == ("rank 0: peer transfer with ranks [1, 2] failed authentication: "
                               f"rank 1: {other_key}; rank 2: {foreign}; the experts they hold are read from "
                               "the checkpoint every round until it is fixed (alarmed once)")
