"""Every Redis key of fdeplb, built in one place.

All keys of one cluster share the hash tag ``{<cluster>}`` so one script can touch them all, also on Redis Cluster.
"""

from __future__ import annotations

import re

from fdeplb.errors import InputError

_CLUSTER_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class Keys:
    """Key names of one cluster. ``cluster`` must match ``[A-Za-z0-9_.-]{1,64}``."""

    def __init__(self, cluster: str) -> None:
        if not isinstance(cluster, str) or not _CLUSTER_ID.match(cluster):
            raise InputError(f"cluster id must match [A-Za-z0-9_.-]{{1,64}}, got {cluster!r}")
        self.cluster = cluster
        self.prefix = f"fdeplb:{{{cluster}}}"

    @property
    def pattern(self) -> str:
        """SCAN ``MATCH`` glob of every key of this cluster (the hash tag's braces escaped): what deleting or
        counting a cluster's keys walks, so a key added to this class is never left behind."""
        return self._glob("")

    @property
    def live_pattern(self) -> str:
        """SCAN ``MATCH`` glob of every rank's live report (:meth:`live`)."""
        return self._glob("live:")

    def _glob(self, sub: str) -> str:
        return f"{self.prefix.replace('{', '[{]').replace('}', '[}]')}:{sub}*"

    @property
    def rearrange(self) -> str:
        """hash: the cluster rearrangement record (state, version, round, plan_id, deadline_ms, reason, ...)."""
        return f"{self.prefix}:rearrange"

    def rank(self, ep_rank: int) -> str:
        """hash: the rank record of ``ep_rank`` (state, version, plan_id, heartbeat_ms, ...)."""
        return f"{self.prefix}:rank:{int(ep_rank)}"

    def weights(self, ep_rank: int) -> str:
        """hash: the weight-status record of ``ep_rank``."""
        return f"{self.prefix}:weights:{int(ep_rank)}"

    def member(self, ep_rank: int) -> str:
        """hash: the membership record of ``ep_rank`` (state, version, generation, deadline_ms, ...)."""
        return f"{self.prefix}:member:{int(ep_rank)}"

    def load(self, ep_rank: int) -> str:
        """hash: the windowed expert_load published by ``ep_rank`` (array fields + round + window bounds)."""
        return f"{self.prefix}:load:{int(ep_rank)}"

    def snapshot(self, round_: int) -> str:
        """hash: the load snapshot frozen for round ``round_`` (``expert_load``: sum of every member's window; for a
        policy that plans per source rank also ``source_load``: the windows unsummed, [L, ep_size, E])."""
        return f"{self.prefix}:snapshot:{int(round_)}"

    @property
    def supplied_load(self) -> str:
        """hash: an expert_load [L, E] supplied by an operator (``recv_expert_weight``) for one round + that round."""
        return f"{self.prefix}:supplied_load"

    @property
    def supplied_placement(self) -> str:
        """hash: the placement the next round goes to instead of planning (a rollback), with its facts."""
        return f"{self.prefix}:supplied_placement"

    def plan(self, plan_id: str) -> str:
        """hash: a stored plan (snapshot, old and new phy2log, policy, topology)."""
        return f"{self.prefix}:plan:{plan_id}"

    @property
    def placement(self) -> str:
        """hash: the cluster's current placement (plan_id, phy2log, version)."""
        return f"{self.prefix}:placement"

    @property
    def audit(self) -> str:
        """stream: one entry per committed transition or audited note, hash-chained; trimmed only by the opt-in
        audit trim, after its records are exported (``audit_keep``, :mod:`fdeplb.store.retention`)."""
        return f"{self.prefix}:audit"

    @property
    def audit_head(self) -> str:
        """string: the ``chain`` of the newest audit record ("" before the first); the commit and alarm scripts
        hash each new record together with it (DESIGN.md section 4) and move it on in the same atomic step."""
        return f"{self.prefix}:audit_head"

    @property
    def events(self) -> str:
        """stream: wake-ups that are not transitions (loads published, alarms, heartbeats); capped."""
        return f"{self.prefix}:events"

    @property
    def signal(self) -> str:
        """stream: one entry per write of the cluster record that rank agents act on (a cluster transition, a
        weight or clear-stat request); capped. Rank agents block on it instead of the audit stream, so a round
        wakes each agent once per cluster transition, not once per rank transition (N, not N**2, wake-ups)."""
        return f"{self.prefix}:signal"

    @property
    def deleted(self) -> str:
        """string: the tombstone of an operator's ``cluster delete`` (JSON: who, when, how many keys), with a TTL;
        written in the transaction that deletes the cluster's keys, removed by the next ``init-cluster``."""
        return f"{self.prefix}:deleted"

    @property
    def lease(self) -> str:
        """string: the coordinator lease, ``<fence>:<holder>``, with a TTL."""
        return f"{self.prefix}:lease"

    @property
    def fence(self) -> str:
        """string: monotonic fencing counter."""
        return f"{self.prefix}:fence"

    @property
    def ranks(self) -> str:
        """hash: registered ranks -> JSON (API address, pid, started_ms)."""
        return f"{self.prefix}:ranks"

    def live(self, ep_rank: int) -> str:
        """hash: the placement a rank agent holds live (phy2log, plan_id, agent_id, reported_ms, ttl_ms), reported
        once the cluster's records are gone (Redis lost its data) for ``init-cluster`` to adopt; expires."""
        return f"{self.prefix}:live:{int(ep_rank)}"

    @property
    def retained(self) -> str:
        """sorted set: snapshot and plan keys -> the round that wrote them (what the coordinator prunes from)."""
        return f"{self.prefix}:retained"

    @property
    def config(self) -> str:
        """hash: cluster topology and rearrangement settings (written once by ``init_cluster``)."""
        return f"{self.prefix}:config"
