"""A rank agent's part in peer-to-peer expert transfer: it serves its live slots to its peers and takes the experts
its new slots need from theirs (:mod:`fdeplb.weights.peer`, :mod:`fdeplb.weights.peer_plan`).

Enabled when the agent has a secret (``RankAgent(peer_secret=...)`` or the ``FDEPLB_PEER_SECRET`` environment
variable): every rank derives the same authentication key from it and the cluster id (:func:`peer_authkey`); with
none, nothing listens and every moved expert is read from the checkpoint, as before. The server's address goes into
the rank registry (``peer_address`` of :meth:`fdeplb.store.Store.register_rank`); a receiver connects only to
addresses registered there, of members of the placement the round starts from, other than itself.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from fdeplb.placement.digest import routing_digest
from fdeplb.store import Store
from fdeplb.store.liveness import stale_of
from fdeplb.weights.backend import Staged, WeightBackend
from fdeplb.weights.peer import (DEFAULT_TIMEOUT_S, MAX_SERVING, ExpertSource, PeerServer, SocketTransport,
                                 peer_authkey)
from fdeplb.weights.peer_plan import CHECKPOINT, peer_sources
from fdeplb.weights.peer_staging import Fallback, PeerFetch
from fdeplb.weights.plan import PauseBudget

#: the environment variable holding the operator's peer-transfer secret
ENV_PEER_SECRET = "FDEPLB_PEER_SECRET"
#: the registry field holding a rank's peer-transfer address
ADDRESS_FIELD = "peer_address"
#: the shortest per-peer wait (seconds): a 42 MiB expert crosses the loopback in tens of milliseconds
MIN_PEER_WAIT_S = 1.0


def peer_wait_s(heartbeat_ttl_ms: int) -> float:
    """How long a receiver waits on one peer (its connect and handshake, each batch's header, each expert's bytes;
    the server's deadline for sending one too), in seconds: half the heartbeat TTL, within
    [:data:`MIN_PEER_WAIT_S`, :data:`~fdeplb.weights.peer.DEFAULT_TIMEOUT_S`]. A peer whose process hangs is
    suspected within its TTL; one that stalls while its heartbeat stays fresh costs each receiver this wait once
    (its later experts fall back with the broken connection), well inside the loading deadline. The receiver
    heartbeats meanwhile (:mod:`~fdeplb.orchestration.busy_heartbeat`)."""
    return min(DEFAULT_TIMEOUT_S, max(MIN_PEER_WAIT_S, int(heartbeat_ttl_ms) / 2000))


def peer_share_s(loading_ms: int) -> float:
    """The most a receiver waits on one peer's whole share of a staging (seconds): half the loading deadline, so
    that what a slow peer did not deliver by then (each expert within :func:`peer_wait_s`, the share not) is
    still read from the checkpoint before the round's loading deadline."""
    return int(loading_ms) / 2000


def peer_secret(explicit: str | None = None) -> str | None:
    """The secret peers authenticate with: ``explicit``, else ``FDEPLB_PEER_SECRET``, else None (peer transfer
    off)."""
    return explicit or os.environ.get(ENV_PEER_SECRET) or None


class PeerService:
    """One rank's peer server and the transfers its staging makes.

    Args:
        source: the rank's weight backend (an :class:`~fdeplb.weights.peer.ExpertSource`).
        secret, cluster: give the authentication key (:func:`peer_authkey`).
        host: the interface the server listens on (loopback by default).
        timeout_s: the deadline of one connection's handshake and of one expert's transfer (:func:`peer_wait_s`).
        share_s: the most a staging waits on one peer in all (:func:`peer_share_s`; None: no bound but
            ``timeout_s`` per wait).
        actor: who the alarm of a failed authentication names (:meth:`stage`).
        max_serving: requests the server answers at once (:class:`~fdeplb.weights.peer.PeerServer`).
    """

    def __init__(self, source: ExpertSource, secret: str, cluster: str, ep_rank: int, ep_size: int, *,
                 host: str = "127.0.0.1", timeout_s: float = DEFAULT_TIMEOUT_S, share_s: float | None = None,
                 actor: str = "", max_serving: int = MAX_SERVING) -> None:
        self._key = peer_authkey(secret, cluster)
        self.ep_rank, self.ep_size = int(ep_rank), int(ep_size)
        self.timeout_s = float(timeout_s)
        self.share_s = share_s
        self.actor = actor or f"rank{self.ep_rank}"
        self.auth_alarmed = False  # the alarm of a failed authentication is raised once per service
        self.server = PeerServer(source, self._key, host=host, timeout_s=timeout_s, max_serving=max_serving)

    @property
    def address(self) -> str:
        return self.server.address

    def stage(self, backend: WeightBackend, new_phy2log: np.ndarray, budget_bytes: int | None,
              pause: PauseBudget | None, members: tuple[int, ...], store: Store) -> Staged:
        """``backend.stage`` of ``new_phy2log`` with the experts new to the rank taken from the peers that hold
        them live (:meth:`fetch_for`), the rest from the checkpoint; the connections are closed after. The first
        time peers fail authentication, one alarm (event and audit record) names them and what each failed
        handshake tells (:func:`~fdeplb.weights.peer.handshake_failure`: another key, or not an fdeplb peer);
        later rounds fall back to the checkpoint without another."""
        fetch = self.fetch_for(backend.phy2log, new_phy2log, members, store)
        try:
            staged = backend.stage(new_phy2log, budget_bytes, pause, peers=fetch)
        finally:
            fetch.transport.close()
        known: dict[int, str] = {}  # peer -> what its failed handshake tells
        for f in getattr(staged, "fallbacks", []):
            if f.unauthenticated:
                known.setdefault(f.peer, f.handshake or f.error)
        if known and not self.auth_alarmed:
            self.auth_alarmed = True
            message = (f"rank {self.ep_rank}: peer transfer with ranks {sorted(known)} failed authentication: "
                       + "; ".join(f"rank {peer}: {what}" for peer, what in sorted(known.items()))
                       + "; the experts they hold are read from the checkpoint every round until it is fixed "
                       "(alarmed once)")
            store.emit_event("alarm", rank=self.ep_rank, message=message)
            store.append_alarm(store.read_cluster(), actor=self.actor, reason=message)
        return staged

    def fetch_for(self, old_phy2log: np.ndarray, new_phy2log: np.ndarray, members: tuple[int, ...],
                  store: Store) -> PeerFetch:
        """What staging ``new_phy2log`` on this rank needs to take experts from peers: the sources over
        ``members`` (the ranks routed to in ``old_phy2log``) whose heartbeat is within its TTL, a transport to
        their registered addresses (a chosen peer without one: that expert comes from the checkpoint). Close
        ``.transport`` after staging."""
        stale = stale_of(store.heartbeats())  # a hung member would cost a deadline: ask only live ones
        registry = store.rank_info()
        sources = peer_sources(old_phy2log, new_phy2log, self.ep_rank, self.ep_size,
                               [r for r in members if r not in stale])
        addresses = {r: str(registry[r][ADDRESS_FIELD]) for r in set(sources.values()) - {CHECKPOINT}
                     if isinstance(registry.get(r, {}).get(ADDRESS_FIELD), str)}
        sources = {k: (r if r in addresses else CHECKPOINT) for k, r in sources.items()}
        transport = SocketTransport(addresses, self._key, timeout_s=self.timeout_s, total_s=self.share_s)
        return PeerFetch(transport, sources, routing_digest(old_phy2log))

    def close(self) -> None:
        self.server.close()


def fallback_reason(fallbacks: list[Fallback]) -> tuple[str, dict[str, Any] | None]:
    """The reason and audit detail of a staging's fallbacks: ``{"fallback": [{"layer", "expert", "peer",
    "error"}, ...], "fallbacks": n}`` (at most 32 listed), or ``("", None)`` when every peer delivered."""
    if not fallbacks:
        return "", None
    peers = sorted({f.peer for f in fallbacks})
    return (f"{len(fallbacks)} experts read from the checkpoint: peer ranks {peers} did not deliver them",
            {"fallback": [f.to_detail() for f in fallbacks[:32]], "fallbacks": len(fallbacks)})
