"""Peer-to-peer expert transfer between the processes of one machine: the :class:`PeerTransport` seam, the server a
rank agent runs over its live slots (:class:`PeerServer`) and the client that fetches from it
(:class:`SocketTransport`).

Wire: TCP on the loopback (or a host the operator gives), framed and authenticated by the standard library's
:mod:`multiprocessing.connection` (length-prefixed messages; an HMAC challenge in both directions with a key every
rank derives from one secret, :func:`peer_authkey`; a connection without the key is refused before any byte of an
expert moves). One request names up to :data:`BATCH_EXPERTS` experts of one peer (and :data:`BATCH_BYTES`),
``{"placement", "experts": [[layer, expert], ...]}``: ``placement`` is the
:func:`~fdeplb.placement.digest.routing_digest` of the placement the receiver expects the peer to hold live; the
peer refuses an expert if the request names another placement (its slots may be about to change) or it does not hold
the expert live. The answer is one JSON header, ``{"answers": [...]}`` with per expert of the request either
``{"ok": true, "sizes": [[suffix, bytes], ...], "checksum"}`` (the expert's checkpoint checksum as the peer verified
it) or ``{"ok": false, "error"}``, followed by one message per suffix of each served expert in request order, which
the receiver reads straight into its staging tensors (``Connection.recv_bytes_into``) and checks expert by expert.
One header per batch, not per expert: the per-expert request, header and their thread wake-ups were most of what the
transfer cost beyond its bytes. Every wait has a deadline (the header's, then each expert's bytes): a socket that
stalls is shut down when it passes.

The GPU transport (NCCL send/recv through ``paddle.distributed`` between the ranks' devices) fits the same seam:
:meth:`PeerTransport.fetch` fills ``into`` (there: device tensors) and returns the peer's checksum; it is not
written yet because it can only be checked on GPUs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
import time
from contextlib import ExitStack, contextmanager
from multiprocessing import AuthenticationError, ProcessError  # ProcessError: BufferTooShort too
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any, Callable, Iterator, NamedTuple, Protocol, runtime_checkable

import structlog

from fdeplb.errors import InputError, PeerAuthError, PeerTransferError
from fdeplb.failpoints import failpoint

log = structlog.get_logger("fdeplb.peer")

#: most experts one request names (a rank's share of a peer is split into requests of at most this many)
BATCH_EXPERTS = 64
#: most bytes of experts one request asks for, unless it names one expert only: a peer holds the copies of a
#: batch's device slots in host memory until they are sent (host slots are sent from their memory, no copy)
BATCH_BYTES = 64 * 1024 * 1024
#: most bytes of one request or answer header (a header of BATCH_EXPERTS answers is a few KiB)
MAX_HEADER = 64 * 1024
#: default deadline of one connect, handshake or expert transfer (seconds; a 42 MiB expert crosses the loopback in
#: tens of milliseconds)
DEFAULT_TIMEOUT_S = 10.0
#: an idle served connection is closed after this long (seconds)
IDLE_S = 120.0
#: default of the requests a server answers at once (:class:`PeerServer`'s ``max_serving``): each holds the host
#: copies of its batch's device slots until they are sent, up to :data:`BATCH_BYTES` (one larger expert alone), so
#: a popular peer holds at most about max_serving x 64 MiB however many receivers connect
MAX_SERVING = 4
#: most connections a server holds before they authenticate (each has a thread and a handshake deadline); one
#: accepted past it is closed at once, so a flood of connections costs no threads
MAX_HANDSHAKES = 32


def check_max_serving(max_serving: Any) -> int:
    """``max_serving`` (a peer server's requests answered at once) as an int >= 1; InputError otherwise."""
    if isinstance(max_serving, bool) or not isinstance(max_serving, int) or max_serving < 1:
        raise InputError(f"max_serving must be an int >= 1 (requests answered at once), got {max_serving!r}")
    return max_serving


def peer_authkey(secret: str, cluster: str) -> bytes:
    """The key peers of ``cluster`` authenticate with: HMAC-SHA256(``secret``, ``"fdeplb-peer:" + cluster``), 32
    bytes. ``secret`` is the operator's (``RankAgent(peer_secret=...)``, else ``FDEPLB_PEER_SECRET``: see
    :func:`fdeplb.orchestration.peer_agent.peer_secret`); InputError when it is empty (never unauthenticated)."""
    if not secret:
        raise InputError("peer transfer needs a non-empty secret (FDEPLB_PEER_SECRET)")
    return hmac.new(secret.encode(), f"fdeplb-peer:{cluster}".encode(), hashlib.sha256).digest()


class PeerRequest(NamedTuple):
    """One expert asked of a peer: MoE layer index, logical expert id, and the routing digest of the placement the
    peer must hold live to serve it."""

    layer: int
    expert: int
    placement: str


@runtime_checkable
class ExpertSource(Protocol):
    """What a :class:`PeerServer` serves from: a rank's live slots (a weight backend)."""

    def serve_expert(self, layer: int, expert: int, placement: str) -> tuple[list[tuple[str, Any]], tuple[int, ...]]:
        """``([(suffix, bytes-like copy of the live slot's tensor)], checkpoint checksum)`` of one live expert, copied
        at one consistent epoch of the live slots. PeerTransferError (a refusal) when the live placement's digest is
        not ``placement`` or no live slot holds ``expert`` in ``layer``.

        A source whose bytes are its live memory may also have ``serving(abort)``: a context manager the server
        holds from the first ``serve_expert`` of a request to the last byte sent, so that the memory is not freed
        meanwhile (``abort()`` ends the send; PeerTransferError: nothing to serve)."""


@runtime_checkable
class PeerTransport(Protocol):
    """Moves one expert from a peer rank's live slot into the caller's staging tensors."""

    def fetch(self, peer: int, request: PeerRequest, into: dict[str, Any]) -> tuple[int, ...]:
        """Fill ``into`` (``suffix -> writable buffer`` of exactly the expert's bytes, in the order the peer sends
        them) from ``peer`` and return the checksum the peer gives for the expert (the caller checks the bytes
        against it). Raises PeerTransferError (refused, dead, past its deadline, unauthenticated, truncated);
        ``into`` may then hold part of the bytes: the caller reads the expert from the checkpoint instead."""

    def fetch_many(self, peer: int, items: list[tuple[PeerRequest, dict[str, Any]]],
                   on_arrival: Callable[[int], None] | None = None) -> list[tuple[int, ...] | PeerTransferError]:
        """:meth:`fetch` for several experts of one peer at once (batched requests, pipelined, answers in order):
        per item the peer's checksum, or the PeerTransferError that item met (after a broken connection, every
        later item has it too). ``on_arrival(k)`` is called as item k's bytes have arrived (e.g. to checksum them
        before the next ones are read)."""

    def close(self) -> None:
        """Close every connection (idempotent)."""


class _Watchdog:
    """One thread per process that shuts sockets down when their deadline passes (arming one costs a lock, not a
    thread: a deadline is armed around every expert sent or received). The thread is woken only by a deadline
    sooner than the one it sleeps until (one armed on an idle watchdog), not by every arm: a wake-up per expert
    cost a thread switch and a GIL hand-off on both sides of every transfer."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, socket.socket]] = {}
        self._next = 0
        self._wake_at = 0.0  # when the thread wakes up next on its own (it checks every deadline then)
        self._thread: threading.Thread | None = None

    def arm(self, sock: socket.socket, seconds: float) -> int:
        when = time.monotonic() + seconds
        with self._cond:
            self._next += 1
            self._armed[self._next] = (when, sock)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fdeplb-peer-deadlines", daemon=True)
                self._thread.start()
            if when < self._wake_at:
                self._wake_at = when
                self._cond.notify()
            return self._next

    def disarm(self, token: int) -> None:
        with self._cond:
            self._armed.pop(token, None)

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for token, (when, sock) in list(self._armed.items()):
                    if when <= now:
                        del self._armed[token]
                        _shutdown(sock)
                self._wake_at = min((when for when, _ in self._armed.values()), default=now + 60.0)
                self._cond.wait(max(self._wake_at - now, 0.001))


_WATCHDOG = _Watchdog()


@contextmanager
def _deadline(sock: socket.socket, seconds: float) -> Iterator[None]:
    """Shut ``sock`` down if the block runs past ``seconds``: a blocked read then returns end-of-file."""
    token = _WATCHDOG.arm(sock, seconds)
    try:
        yield
    finally:
        _WATCHDOG.disarm(token)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class PeerHandshakeError(PeerAuthError):
    """A failed handshake with a peer's address, and what it tells (``handshake``: :func:`handshake_failure`)."""

    def __init__(self, message: str, handshake: str) -> None:
        super().__init__(message)
        self.handshake = handshake


def handshake_failure(err: BaseException, address: str) -> str:
    """What a failed :mod:`multiprocessing.connection` handshake with the server at ``address`` tells, no more:
    the challenge's HMAC proves only that both ends hold the same key, so a refusal of this rank's key is either
    another key (another ``FDEPLB_PEER_SECRET`` or cluster id) or another program listening there; a server that
    takes the key without answering the challenge, or sends no challenge, is not an fdeplb peer."""
    text = str(err)
    if "digest sent was rejected" in text:
        return (f"the server at {address} refused this rank's key: it holds another one (another "
                "FDEPLB_PEER_SECRET or cluster id) or is not an fdeplb peer (another program listening at the "
                "registered address)")
    if "digest received was wrong" in text:
        return (f"the server at {address} took this rank's key but failed its challenge: not an fdeplb peer "
                "holding the key (another program listening at the registered address)")
    return (f"the server at {address} sent no authentication challenge ({text[:100]}): not an fdeplb peer "
            "(another program listening at the registered address)")


class _Link:
    """One authenticated connection: the framed :class:`Connection` and a duplicate of its socket to shut down."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self.guard = sock.dup()
        self.conn = Connection(sock.detach())

    def close(self) -> None:
        _shutdown(self.guard)
        self.guard.close()
        self.conn.close()


def _json(conn: Connection) -> dict:
    data = json.loads(conn.recv_bytes(MAX_HEADER))
    if not isinstance(data, dict):
        raise ValueError("a header must be a JSON object")
    return data


class PeerServer:
    """Serves a rank's live experts to its peers: one accepting thread, one thread per connection (daemons; at most
    :data:`MAX_HANDSHAKES` of them not yet authenticated).

    Args:
        source: the live slots (:class:`ExpertSource`).
        authkey: :func:`peer_authkey` (bytes, >= 16).
        host: the interface to listen on (default the loopback); the port is chosen by the system.
        timeout_s: deadline of a connection's handshake and of sending one expert.
        max_serving: requests answered at once, over all connections (default :data:`MAX_SERVING`, >= 1): the
            bound on the host copies the server holds (max_serving x :data:`BATCH_BYTES`). A request past it waits
            for a free turn up to half of ``timeout_s`` (within the receiver's wait for its header), then is refused
            whole (``peer busy: ...``, a warning): the receiver reads those experts from the checkpoint.

    Attributes:
        address: ``"host:port"`` to register with the rank (:meth:`fdeplb.store.Store.register_rank`).
        served, refused: experts sent, requests refused (counters).
        busy: requests refused because ``max_serving`` others were being answered (counted in ``refused`` too).
        turned_away: connections closed unserved because :data:`MAX_HANDSHAKES` others were authenticating.

    Raises:
        InputError: an authkey under 16 bytes, ``max_serving`` not an int >= 1.
    """

    def __init__(self, source: ExpertSource, authkey: bytes, *, host: str = "127.0.0.1",
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_serving: int = MAX_SERVING) -> None:
        if len(authkey) < 16:
            raise InputError("a peer authkey needs at least 16 bytes (peer_authkey)")
        self.max_serving = check_max_serving(max_serving)
        self._serving = threading.BoundedSemaphore(max_serving)
        self.busy = 0
        self.source, self._key, self.timeout_s = source, bytes(authkey), float(timeout_s)
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.5)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self.served = self.refused = self.turned_away = 0
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._thread = threading.Thread(target=self._accept, name="fdeplb-peer-accept", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting (idempotent); connections in flight end with their peer or their deadline."""
        self._stop.set()
        _shutdown(self._sock)  # wakes the accepting thread: closing alone left the port accepting until its timeout
        self._sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if not self._handshakes.acquire(blocking=False):  # released once its handshake ends, either way
                self.turned_away += 1
                log.warning("peer connection turned away", reason=f"{MAX_HANDSHAKES} connections authenticating")
                _shutdown(sock)
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock,), name="fdeplb-peer-serve", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        link = None
        try:
            try:
                link = _Link(sock)
                with _deadline(link.guard, self.timeout_s):
                    deliver_challenge(link.conn, self._key)
                    answer_challenge(link.conn, self._key)
            finally:  # authenticated or not, it no longer counts against MAX_HANDSHAKES
                self._handshakes.release()
            while not self._stop.is_set() and link.conn.poll(IDLE_S):
                self._answer(link)
        except (ProcessError, EOFError, OSError, ValueError) as err:
            log.info("peer connection closed", reason=f"{type(err).__name__}: {err}")
        finally:
            if link is not None:
                link.close()
            else:
                sock.close()

    def _answer(self, link: _Link) -> None:
        with _deadline(link.guard, self.timeout_s):  # its first byte is in: the rest of the frame is due now
            req = _json(link.conn)
        try:
            placement, experts = str(req["placement"]), [(int(e[0]), int(e[1])) for e in req["experts"]]
            if not 0 < len(experts) <= BATCH_EXPERTS:
                raise ValueError(f"a request names 1 to {BATCH_EXPERTS} experts, not {len(experts)}")
        except (KeyError, TypeError, ValueError, IndexError, OverflowError) as err:  # the whole request is refused
            self.refused += 1
            link.conn.send_bytes(json.dumps({"ok": False, "error": f"bad request: {err}"[:500]}).encode())
            return
        if not self._serving.acquire(timeout=self.timeout_s / 2):
            self.refused += 1
            self.busy += 1
            error = (f"peer busy: {self.max_serving} requests are being answered (max_serving), each holding up to "
                     f"{BATCH_BYTES >> 20} MiB of host copies")
            log.warning("peer request refused", reason=error, experts=len(experts))
            link.conn.send_bytes(json.dumps({"ok": False, "error": error}).encode())
            return
        with ExitStack() as held:
            held.callback(self._serving.release)
            hold = getattr(self.source, "serving", None)
            try:
                if hold is not None:  # the slots' memory stays allocated until the last byte is sent
                    held.enter_context(hold(lambda: _shutdown(link.guard)))
            except PeerTransferError as err:
                self.refused += 1
                link.conn.send_bytes(json.dumps({"ok": False, "error": str(err)[:500]}).encode())
                return
            self._send_experts(link, placement, experts)

    def _send_experts(self, link: _Link, placement: str, experts: list[tuple[int, int]]) -> None:
        answers, served = [], []
        for layer, expert in experts:
            try:
                parts, checksum = self.source.serve_expert(layer, expert, placement)
            except Exception as err:  # noqa: BLE001 - any failure to read the slot is a refusal of that expert
                if not isinstance(err, (KeyError, TypeError, ValueError, PeerTransferError)):
                    log.warning("peer request failed", error=f"{type(err).__name__}: {err}")
                self.refused += 1
                answers.append({"ok": False, "error": str(err)[:500]})
                continue
            answers.append({"ok": True, "checksum": list(checksum),
                            "sizes": [[s, memoryview(b).nbytes] for s, b in parts]})
            served.append(parts)
        with _deadline(link.guard, self.timeout_s):
            link.conn.send_bytes(json.dumps({"answers": answers}).encode())
        for parts in served:
            with _deadline(link.guard, self.timeout_s):
                for k, (_, data) in enumerate(parts):
                    if k == len(parts) - 1:  # tests: a peer killed mid-transfer (its header sent, not all its bytes)
                        failpoint("peer.hang", "sending", lambda: log.warning("failpoint hit", failpoint="peer.hang"))
                    link.conn.send_bytes(data)
            self.served += 1


def _batches(requests: list[tuple[PeerRequest, int]]) -> list[tuple[str, list[PeerRequest]]]:
    """``(request, expert bytes)`` in order, cut into runs of one placement, at most :data:`BATCH_EXPERTS` experts
    and :data:`BATCH_BYTES` bytes (a larger expert alone)."""
    out: list[tuple[str, list[PeerRequest]]] = []
    size = 0
    for r, nbytes in requests:
        if (not out or out[-1][0] != r.placement or len(out[-1][1]) == BATCH_EXPERTS
                or size + nbytes > BATCH_BYTES):
            out.append((r.placement, []))
            size = 0
        out[-1][1].append(r)
        size += nbytes
    return out


class SocketTransport:
    """:class:`PeerTransport` over :class:`PeerServer` connections (one cached connection per peer, thread-safe per
    peer: fetch from several peers in parallel).

    Args:
        addresses: ``peer rank -> "host:port"``, only registered addresses (the rank registry's ``peer_address``).
        authkey: :func:`peer_authkey`.
        timeout_s: deadline of a connect + handshake, and of one expert's transfer.
        total_s: the most one :meth:`fetch_many` waits on its peer in all (None: no bound but ``timeout_s`` per
            wait): a peer slow enough to deliver each expert within ``timeout_s`` but its share not within this
            has the rest of its items fail (PeerTransferError; the connection is dropped).
    """

    def __init__(self, addresses: dict[int, str], authkey: bytes, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 total_s: float | None = None) -> None:
        self.addresses = {int(r): str(a) for r, a in addresses.items()}
        self._key, self.timeout_s = bytes(authkey), float(timeout_s)
        self.total_s = None if total_s is None else float(total_s)
        self._links: dict[int, _Link] = {}
        self._locks: dict[int, threading.Lock] = {r: threading.Lock() for r in self.addresses}

    def _link(self, peer: int) -> _Link:
        link = self._links.get(peer)
        if link is not None:
            return link
        host, _, port = self.addresses[peer].rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
        link = _Link(sock)
        try:
            with _deadline(link.guard, self.timeout_s):
                try:
                    answer_challenge(link.conn, self._key)
                except AssertionError as err:  # Python < 3.12: a first message that is no challenge
                    raise AuthenticationError(f"protocol error, expected a challenge: {err}") from None
                deliver_challenge(link.conn, self._key)
        except BaseException:
            link.close()
            raise
        self._links[peer] = link
        return link

    def fetch(self, peer: int, request: PeerRequest, into: dict[str, Any]) -> tuple[int, ...]:
        result = self.fetch_many(peer, [(request, into)])[0]
        if isinstance(result, PeerTransferError):
            raise result
        return result

    def fetch_many(self, peer: int, items: list[tuple[PeerRequest, dict[str, Any]]],
                   on_arrival: Callable[[int], None] | None = None) -> list[tuple[int, ...] | PeerTransferError]:
        if peer not in self.addresses:
            err = PeerTransferError(f"rank {peer} has no registered peer address")
            return [err] * len(items)
        out: list[tuple[int, ...] | PeerTransferError] = []
        batches = _batches([(request, sum(memoryview(b).nbytes for b in into.values()))
                            for request, into in items])
        end = None if self.total_s is None else time.monotonic() + self.total_s
        with self._locks[peer]:
            try:
                link = self._link(peer)
                with _deadline(link.guard, self._wait_s(end)):
                    for placement, requests in batches:  # a few KiB each: they fit the socket's buffers
                        link.conn.send_bytes(json.dumps({"placement": placement, "experts": [
                            [r.layer, r.expert] for r in requests]}).encode())
                for _, requests in batches:
                    with _deadline(link.guard, self._wait_s(end)):
                        answers = self._answers(peer, link, requests)
                    for answer in answers:
                        request, into = items[len(out)]
                        try:
                            out.append(self._receive(peer, link, request, answer, into, self._wait_s(end)))
                            if on_arrival is not None:
                                on_arrival(len(out) - 1)
                        except PeerTransferError as err:  # a refusal: the connection is still in step
                            out.append(err)
                            if peer not in self._links:
                                break
                    if peer not in self._links:
                        break
            except (ProcessError, EOFError, OSError, ValueError, KeyError, TypeError, OverflowError) as err:
                self._drop(peer)  # OverflowError: a header's int that is JSON's Infinity or 1e999
                request = items[len(out)][0]
                late = end is not None and time.monotonic() >= end and not isinstance(err, TimeoutError)
                message = (f"rank {peer} ({self.addresses[peer]}) did not deliver expert {request.expert} of layer "
                           f"{request.layer}: {type(err).__name__}: {err}")
                if isinstance(err, AuthenticationError):
                    known = handshake_failure(err, self.addresses[peer])
                    out.append(PeerHandshakeError(f"{message}; {known}", known))
                else:
                    out.append(PeerTransferError(
                        message + (f" (cut: its share took longer than {self.total_s:g} s)" if late else "")))
        cause = out[-1] if out else None
        while len(out) < len(items):  # the connection broke: what broke it, for every later item
            if isinstance(cause, PeerHandshakeError):
                out.append(PeerHandshakeError(f"rank {peer} failed earlier: {cause}", cause.handshake))
            else:
                kind = type(cause) if isinstance(cause, PeerTransferError) else PeerTransferError
                out.append(kind(f"rank {peer} failed earlier: {cause}"))
        return out

    def _wait_s(self, end: float | None) -> float:
        """The next wait's deadline: ``timeout_s``, cut to what is left of ``total_s`` (``end``). TimeoutError
        once nothing is left."""
        if end is None:
            return self.timeout_s
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"its share took longer than {self.total_s:g} s")
        return min(self.timeout_s, left)

    def _answers(self, peer: int, link: _Link, requests: list[PeerRequest]) -> list[dict]:
        """The header answering one batch: one answer per request (a refused batch: a refusal per request)."""
        head = _json(link.conn)
        if "answers" not in head:
            return [{"ok": False, "error": head.get("error", "no answers")}] * len(requests)
        answers = head["answers"]
        if not isinstance(answers, list) or len(answers) != len(requests) or not all(
                isinstance(a, dict) for a in answers):
            raise ValueError(f"rank {peer} answered {len(requests)} requests with a header of another shape")
        return answers

    def _receive(self, peer: int, link: _Link, request: PeerRequest, head: dict, into: dict[str, Any],
                 wait_s: float) -> tuple[int, ...]:
        """Read the bytes ``head`` (the item's answer) announces into ``into`` within ``wait_s``; the answer's
        checksum."""
        with _deadline(link.guard, wait_s):
            if not head.get("ok"):
                raise PeerTransferError(f"rank {peer} refused expert {request.expert} of layer {request.layer}: "
                                        f"{head.get('error', '')}")
            sizes = [(str(s), int(n)) for s, n in head["sizes"]]
            want = [(s, memoryview(b).nbytes) for s, b in into.items()]
            if sizes != want:
                self._drop(peer)  # the payload that follows is not read: the connection is out of step
                raise PeerTransferError(f"rank {peer} sends {sizes} for expert {request.expert} of layer "
                                        f"{request.layer}, staging expects {want}")
            for suffix, buf in into.items():
                got = link.conn.recv_bytes_into(buf)
                if got != memoryview(buf).nbytes:
                    self._drop(peer)
                    raise PeerTransferError(f"rank {peer} sent a truncated frame for {suffix!r} of expert "
                                            f"{request.expert} of layer {request.layer}: {got} of "
                                            f"{memoryview(buf).nbytes} bytes")
            return tuple(int(c) for c in head["checksum"])

    def _drop(self, peer: int) -> None:
        link = self._links.pop(peer, None)
        if link is not None:
            link.close()

    def close(self) -> None:
        for peer in list(self._links):
            self._drop(peer)
