"""Staging from peers: the experts a plan loads, taken from the live slots of the peer ranks that hold them
(:func:`~fdeplb.weights.peer_plan.peer_sources`), each checked against its checkpoint checksum on arrival, and
read from the checkpoint instead when no peer holds it or its peer fails.

One thread per serving peer fetches that peer's share in plan order (one request and one header per batch of experts
on one connection: :mod:`fdeplb.weights.peer`), straight into staging tensors (from ``allocate``: the reader's
recycled buffers where it has them), and checksums each expert as soon as its bytes are in, while they are still in
cache; the other peers' threads receive meanwhile. (google-crc32c holds the GIL for buffers that are not ``bytes``
of 1 MiB or more, so a checksum thread of its own would overlap nothing.) An expert is taken from the peer only if
the CRC-32C of the bytes that arrived equals the checksum the peer gives for it (recorded when the peer read it from
the checkpoint) and, where the receiver knows the checkpoint's checksum of that expert itself, that one too.
Anything else (a refusal, a dead peer, a deadline, a truncated frame, wrong bytes) is a :class:`Fallback`: that
expert (and, after a broken connection, every later one of the same peer) is read from the checkpoint, and the
caller audits the fallbacks (``detail.fallback`` of the rank's ``staged`` transition). Nothing half-received is
kept: a failed expert's tensors are dropped before the disk read.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from fdeplb.errors import PeerAuthError, PeerTransferError
from fdeplb.weights.peer import PeerRequest, PeerTransport
from fdeplb.weights.peer_plan import CHECKPOINT

#: most peers fetched from at once (one thread each; an EP group rarely has more ranks)
MAX_PEER_THREADS = 64
#: ``(layer, expert) -> suffix -> empty staging tensor`` (host memory)
Allocate = Callable[[int, int], dict[str, Any]]


class Fallback(NamedTuple):
    """An expert a peer did not deliver, read from the checkpoint instead (``unauthenticated``: the peer and this
    rank do not share the key, :class:`~fdeplb.errors.PeerAuthError`)."""

    layer: int
    expert: int
    peer: int
    error: str
    unauthenticated: bool = False
    #: what the failed handshake tells (:func:`~fdeplb.weights.peer.handshake_failure`); "" for other fallbacks
    handshake: str = ""

    def to_detail(self) -> dict[str, Any]:
        """The audit detail of this fallback (``detail.fallback`` lists these)."""
        return {"layer": self.layer, "expert": self.expert, "peer": self.peer, "error": self.error[:300]}


@dataclass(frozen=True)
class PeerFetch:
    """What staging needs to take experts from peers.

    Attributes:
        transport: the :class:`~fdeplb.weights.peer.PeerTransport` (closed by the caller).
        sources: ``(layer, expert) -> peer rank or CHECKPOINT`` (:func:`~fdeplb.weights.peer_plan.peer_sources`).
        placement: routing digest of the placement the peers must hold live (the round's old placement).
        known: ``(layer, expert) -> checkpoint checksum`` the receiver knows itself (checked too when present).
    """

    transport: PeerTransport
    sources: dict[tuple[int, int], int]
    placement: str
    known: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)


@dataclass
class PeerResult:
    """What :func:`fetch_from_peers` got: ``got[index] = (tensors, checksum)`` for the indices into the plan's disk
    list that arrived and verified, ``fallbacks`` for those that did not, ``peer_bytes`` the bytes that did."""

    got: dict[int, tuple[dict[str, Any], tuple[int, ...]]] = field(default_factory=dict)
    fallbacks: list[Fallback] = field(default_factory=list)
    peer_bytes: int = 0


def fetch_from_peers(disk: tuple[tuple[int, int], ...] | list[tuple[int, int]], fetch: PeerFetch,
                     allocate: Allocate, view: Callable[[Any], Any],
                     checksum: Callable[[dict[str, Any]], tuple[int, ...]]) -> PeerResult:
    """Fetch every expert of ``disk`` whose source is a peer, one thread per peer.

    Args:
        disk: ``(layer, expert)`` pairs (a plan's :attr:`~fdeplb.weights.plan.TransferPlan.disk`).
        fetch: the transport, the sources and the placement (:class:`PeerFetch`).
        allocate: new staging tensors for one expert (``suffix -> tensor``).
        view: a writable byte buffer over one staging tensor's memory.
        checksum: the expert checksum of the received bytes (``suffix -> buffer`` from ``view``), as the live
            slots are verified with (one value per suffix, in order).

    Returns:
        :class:`PeerResult`; never raises for a peer's failure (it is a :class:`Fallback`).
    """
    by_peer: dict[int, list[int]] = {}
    for index, key in enumerate(disk):
        peer = fetch.sources.get((int(key[0]), int(key[1])), CHECKPOINT)
        if peer != CHECKPOINT:
            by_peer.setdefault(int(peer), []).append(index)
    result = PeerResult()
    if not by_peer:
        return result

    def run(peer: int) -> PeerResult:
        out = PeerResult()
        keys = [tuple(int(v) for v in disk[index]) for index in by_peer[peer]]
        tensors = [allocate(layer, expert) for layer, expert in keys]
        views = [{s: view(t) for s, t in ts.items()} for ts in tensors]
        sums: dict[int, tuple[int, ...]] = {}  # checksummed as each arrives, while the next ones travel
        answers = fetch.transport.fetch_many(peer, [
            (PeerRequest(layer, expert, fetch.placement), v) for (layer, expert), v in zip(keys, views)],
            lambda k: sums.__setitem__(k, checksum(views[k])))
        for k, (index, (layer, expert), ts, claimed) in enumerate(zip(by_peer[peer], keys, tensors, answers)):
            if not isinstance(claimed, PeerTransferError):
                got = sums[k] if k in sums else checksum(views[k])
                want = fetch.known.get((layer, expert), claimed)
                if got == claimed == want:
                    out.got[index] = (ts, got)
                    out.peer_bytes += sum(memoryview(v).nbytes for v in views[k].values())
                    continue
                claimed = PeerTransferError(f"rank {peer} sent wrong bytes for expert {expert} of layer {layer}: "
                                            f"checksum {list(got)}, the checkpoint's {list(want)}")
            out.fallbacks.append(Fallback(layer, expert, peer, str(claimed), isinstance(claimed, PeerAuthError),
                                          getattr(claimed, "handshake", "")))
        return out

    threads = min(MAX_PEER_THREADS, len(by_peer))
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fdeplb-peer-fetch") as pool:
        for part in pool.map(run, sorted(by_peer)):
            result.got.update(part.got)
            result.fallbacks.extend(part.fallbacks)
            result.peer_bytes += part.peer_bytes
    result.fallbacks.sort()
    return result
