"""Prometheus metrics of one cluster, computed from Redis at scrape time (prometheus-client custom collector).

Counters and histograms come from the audit stream, read incrementally (each scrape reads only the records
appended since the last one), so every ``fdeplb serve`` process reports the same numbers for the same stream.
Gauges come from the records as they are now.

- ``fdeplb_transitions_total{machine, from, to}``, ``fdeplb_alarms_total``
- ``fdeplb_round_duration_seconds`` (a round: FREE -> ... -> FREE), ``fdeplb_phase_duration_seconds{phase}``
  (time spent in each cluster state before leaving it), histograms
- ``fdeplb_replacement_rounds_total`` (rounds that re-placed a lost rank's orphaned experts: their ``load``),
  ``fdeplb_fail_closed_total`` (re-placements refused because an expert would have no replica on a member)
- ``fdeplb_rounds_aborted_total{reason}``, ``fdeplb_rounds_skipped_total{reason}`` (gated rounds are skips);
  ``reason`` is the reason's first clause with digits replaced by ``N`` (bounded label values);
  ``fdeplb_rounds_probe_mismatch_total`` (rounds whose outcome is ``probe_mismatch``:
  :func:`~fdeplb.rounds.reasons.round_outcome`, as ``rearrange --wait`` and /ui read it)
- ``fdeplb_balancedness{placement="current"|"planned"}`` on the latest round's load snapshot, each over the members
  the placement is routed over (:func:`~fdeplb.rounds.gating.mean_balancedness`), ``fdeplb_moved_experts``
  of the latest plan
- ``fdeplb_cross_node_fraction{placement="current"|"planned"}`` (a cluster of several nodes): the share of tokens
  that leave their source rank's node (:func:`fdeplb.placement.cross_node_fraction`, mean over layers) on the
  ranks' last published windows, the load per source rank (:func:`fdeplb.status.source_load`)
- ``fdeplb_cluster_state_code`` (FastDeploy code), ``fdeplb_round``, ``fdeplb_heartbeat_age_seconds{ep_rank}``,
  ``fdeplb_staging_bytes{ep_rank}`` (bytes read + copied by the rank's last staging),
  ``fdeplb_swap_probe_failed{ep_rank}`` / ``fdeplb_swap_probe_seconds{ep_rank, when}`` (the output probe of the
  rank's last swap: failed or not, its runs before the switch and after the last chunk)
- ``fdeplb_up``: 1 when Redis answered the scrape, 0 when it did not (only then); ``fdeplb_corrupt_records``: the
  stored values this scrape read that did not parse (the configuration, the cluster, rank and weight-status records,
  the placement, the latest plan or load snapshot). The other gauges skip such a value instead of failing: a corrupt
  cluster record drops ``fdeplb_cluster_state_code`` and ``fdeplb_round``, a corrupt rank record that rank's
  series; a corrupt configuration leaves only these two.
"""

from __future__ import annotations

import re
import threading
from collections import Counter, defaultdict

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from fdeplb.errors import CorruptRecordError, FdeplbError, NotFoundError, RedisUnavailableError
from fdeplb.machines.tables import CLUSTER, RANK, WEIGHTS, ClusterState
from fdeplb.rounds import reasons
from fdeplb.rounds.gating import mean_balancedness
from fdeplb.store import Store

#: histogram bucket bounds in seconds
BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, float("inf"))


def reason_label(reason: str) -> str:
    """A bounded label for a free-text reason: its first clause, digits as N, at most 60 characters."""
    head = re.split(r"[:;(]", reason or "unknown", maxsplit=1)[0].strip() or "unknown"
    return re.sub(r"\d+", "N", head)[:60]


class _Histogram:
    def __init__(self) -> None:
        self.counts = [0] * len(BUCKETS)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.total += seconds
        for i, bound in enumerate(BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1

    def buckets(self) -> list[tuple[str, int]]:
        return [("+Inf" if b == float("inf") else repr(b), c) for b, c in zip(BUCKETS, self.counts)]


class ClusterCollector(Collector):
    """Collects the metrics of ``store``'s cluster (see the module doc). Thread-safe."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._last_id = "0-0"
        self._transitions: Counter = Counter()
        self._alarms = 0
        self._replacements = 0
        self._fail_closed = 0
        self._probe_mismatch = 0
        self._of_round: dict = {}  # the round's swapped and load (its outcome)
        self._aborted: Counter = Counter()
        self._skipped: Counter = Counter()
        self._round = _Histogram()
        self._phases: dict[str, _Histogram] = defaultdict(_Histogram)
        self._entered: tuple[str, int] | None = None  # cluster state and when it was entered (ms)
        self._round_start: int | None = None

    def _consume(self) -> None:
        for rec in self.store.audit(f"({self._last_id}" if self._last_id != "0-0" else "-", "+", count=100_000):
            self._last_id = rec.id
            if rec["trigger"] == "alarm":
                self._alarms += 1
                continue
            self._transitions[(rec["machine"], rec["from"], rec["to"])] += 1
            if rec["machine"] != CLUSTER.name:
                continue
            try:
                self._replacements += reasons.is_replacement(rec)
            except ValueError:  # a detail that does not parse: not counted (the replay names it)
                pass
            self._fail_closed += reasons.failed_closed(rec)
            try:
                ts = int(rec["ts_ms"])
            except ValueError:
                continue
            if self._entered is not None and self._entered[0] == rec["from"] and rec["from"] != ClusterState.FREE:
                self._phases[rec["from"]].observe((ts - self._entered[1]) / 1000)
            self._entered = (rec["to"], ts)
            if rec["trigger"] in ("swapped", "load"):
                self._of_round[rec["trigger"]] = rec
            if rec["from"] == ClusterState.FREE:
                self._round_start, self._of_round = ts, {}
            elif rec["to"] == ClusterState.FREE:
                outcome = reasons.round_outcome(rec, self._of_round.get("swapped"), self._of_round.get("load"))[0]
                self._probe_mismatch += outcome is reasons.RoundOutcome.PROBE_MISMATCH
                if self._round_start is not None:
                    self._round.observe((ts - self._round_start) / 1000)
                self._round_start = None
                if rec["trigger"] == "abort":
                    reason = rec["reason"]
                    target = self._skipped if reason.startswith("gated") else self._aborted
                    target[reason_label(reason)] += 1

    def collect(self):
        with self._lock:
            try:
                self._consume()
            except FdeplbError:
                pass  # Redis away: the counters so far, and fdeplb_up 0 below
            yield from self._counters()
        yield from self._gauges()

    def _counters(self):
        t = CounterMetricFamily("fdeplb_transitions", "Committed transitions", labels=["machine", "from", "to"])
        for (machine, src, dst), n in sorted(self._transitions.items()):
            t.add_metric([machine, src, dst], n)
        yield t
        yield CounterMetricFamily("fdeplb_alarms", "Alarms raised after the commit point", value=self._alarms)
        yield CounterMetricFamily("fdeplb_replacement_rounds", "Rounds that re-placed the orphaned experts of ranks "
                                  "that are not members", value=self._replacements)
        yield CounterMetricFamily("fdeplb_fail_closed", "Re-placements refused: an expert would have no replica on "
                                  "a member", value=self._fail_closed)
        yield CounterMetricFamily("fdeplb_rounds_probe_mismatch", "Rounds that swapped but whose output probe failed "
                                  "on some rank (rolled back)", value=self._probe_mismatch)
        for name, counts, doc in (("fdeplb_rounds_aborted", self._aborted, "Rounds aborted, by reason"),
                                  ("fdeplb_rounds_skipped", self._skipped, "Rounds skipped (gated), by reason")):
            fam = CounterMetricFamily(name, doc, labels=["reason"])
            for reason, n in sorted(counts.items()):
                fam.add_metric([reason], n)
            yield fam
        h = HistogramMetricFamily("fdeplb_round_duration_seconds", "Rounds from FREE back to FREE")
        h.add_metric([], self._round.buckets(), self._round.total)
        yield h
        p = HistogramMetricFamily("fdeplb_phase_duration_seconds", "Time in each cluster state", labels=["phase"])
        for phase, hist in sorted(self._phases.items()):
            p.add_metric([phase], hist.buckets(), hist.total)
        yield p

    def _gauges(self):
        up = GaugeMetricFamily("fdeplb_up", "1 when Redis answered this scrape (whatever the values it holds)")
        corrupt: set[str] = set()
        try:
            gauges = list(self._state_gauges(corrupt))
        except RedisUnavailableError:
            up.add_metric([], 0)
            yield up
            return
        except CorruptRecordError as err:  # the configuration: nothing can be laid out without it
            corrupt.add(err.key or str(err))
            gauges = []
        except FdeplbError:  # Redis answered, but no cluster there (or it refused a command): no state gauges
            gauges = []
        up.add_metric([], 1)
        yield up
        yield GaugeMetricFamily("fdeplb_corrupt_records", "Stored values read by this scrape that did not parse "
                                "(the other gauges skip them)", value=len(corrupt))
        yield from gauges

    def _state_gauges(self, corrupt: set[str]):
        """The gauges from the records as they are now; a value that does not parse is added to ``corrupt`` (its
        key) and skipped. Raises what reading the configuration raises."""

        def parsed(read, *args):
            try:
                return read(*args)
            except CorruptRecordError as err:
                corrupt.add(err.key or str(err))
                return None

        store = self.store
        cfg = store.read_config()
        rec = parsed(store.read_cluster)
        if rec is not None:
            yield GaugeMetricFamily("fdeplb_cluster_state_code", "FastDeploy rearrange status code of the cluster",
                                    value=CLUSTER.to_code(rec.state))
            yield GaugeMetricFamily("fdeplb_round", "Round in progress or last finished", value=rec.round)
        bal = GaugeMetricFamily("fdeplb_balancedness", "Mean over layers of mean/max GPU load on the latest "
                                "round's load snapshot, over the members the placement is routed over",
                                labels=["placement"])
        moved = GaugeMetricFamily("fdeplb_moved_experts", "Moved experts of the latest plan")
        plan = parsed(store.read_plan, rec.plan_id) if rec is not None and rec.plan_id else None
        snapshot = (plan.expert_load if plan is not None
                    else parsed(store.read_snapshot, rec.round) if rec is not None else None)
        try:  # read on every scrape, also without a snapshot: a corrupt placement is counted
            placement = parsed(store.current_placement)
        except NotFoundError:
            placement = None
        if snapshot is not None and placement is not None:
            bal.add_metric(["current"], mean_balancedness(snapshot, placement.phy2log, cfg.ep_size,
                                                          placement.live_ranks(cfg.ep_size)))
        if plan is not None:
            bal.add_metric(["planned"], plan.balancedness_after)
            moved.add_metric([], plan.moved_experts)
        yield bal
        yield moved
        if cfg.num_nodes > 1 and placement is not None:
            yield self._cross_node(cfg, placement, plan, corrupt)
        now = store.now_ms()
        age = GaugeMetricFamily("fdeplb_heartbeat_age_seconds", "Age of each rank's last heartbeat",
                                labels=["ep_rank"])
        staging = GaugeMetricFamily("fdeplb_staging_bytes", "Bytes read and copied by each rank's last staging",
                                    labels=["ep_rank"])
        by_source = GaugeMetricFamily("fdeplb_staging_source_bytes", "Bytes of each rank's last staging by source: "
                                      "disk (the checkpoint), peer (peers' live slots), local (its own slots)",
                                      labels=["ep_rank", "source"])
        pause_max = GaugeMetricFamily("fdeplb_swap_pause_max_seconds", "Longest safe-point pause of each rank's "
                                      "last swap (one chunk of layers)", labels=["ep_rank"])
        pause_sum = GaugeMetricFamily("fdeplb_swap_pause_sum_seconds", "Safe-point pauses of each rank's last swap "
                                      "together", labels=["ep_rank"])
        chunks = GaugeMetricFamily("fdeplb_swap_chunks", "Safe points (chunks of layers) each rank's last swap was "
                                   "applied in", labels=["ep_rank"])
        probe_failed = GaugeMetricFamily("fdeplb_swap_probe_failed", "1 when the output probe of each rank's last "
                                         "swap disagreed or raised, 0 when it agreed", labels=["ep_rank"])
        probe_s = GaugeMetricFamily("fdeplb_swap_probe_seconds", "The output probe's runs in each rank's last swap "
                                    "(before the switch, after the last chunk)", labels=["ep_rank", "when"])
        for r, rank in enumerate(store.read_each(RANK)):
            if isinstance(rank, CorruptRecordError):
                corrupt.add(rank.key or str(rank))
                continue
            if rank is None:
                continue
            if rank.heartbeat_ms:
                age.add_metric([str(r)], max(now - rank.heartbeat_ms, 0) / 1000)
            staging.add_metric([str(r)], rank.disk_bytes + rank.peer_bytes + rank.local_bytes)
            for source, nbytes in (("disk", rank.disk_bytes), ("peer", rank.peer_bytes), ("local", rank.local_bytes)):
                by_source.add_metric([str(r), source], nbytes)
            if rank.chunks:
                pause_max.add_metric([str(r)], rank.pause_max_ms / 1000)
                pause_sum.add_metric([str(r)], rank.pause_sum_ms / 1000)
                chunks.add_metric([str(r)], rank.chunks)
            if rank.probe:  # a probe is registered and ran in the last swap
                probe_failed.add_metric([str(r)], 0 if rank.probe == "agree" else 1)
                probe_s.add_metric([str(r), "before"], rank.probe_before_ms / 1000)
                probe_s.add_metric([str(r), "after"], rank.probe_after_ms / 1000)
        corrupt.update(w.key or str(w) for w in store.read_each(WEIGHTS) if isinstance(w, CorruptRecordError))
        yield age
        yield staging
        yield by_source
        yield pause_max
        yield pause_sum
        yield chunks
        yield probe_failed
        yield probe_s
        yield from self._member_gauges(rec, corrupt)

    def _cross_node(self, cfg, placement, plan, corrupt: set[str]) -> GaugeMetricFamily:
        """``fdeplb_cross_node_fraction`` of the current and the latest planned placement on the published windows;
        no sample before any routed rank published one."""
        from fdeplb.errors import StateError
        from fdeplb.placement import cross_node_fraction
        from fdeplb.status import source_load

        gauge = GaugeMetricFamily("fdeplb_cross_node_fraction", "Mean over layers of the share of tokens that leave "
                                  "their source rank's node, on the ranks' published windows", labels=["placement"])
        try:
            stack = np.moveaxis(source_load(self.store)[0], 0, 1)  # [L, ep_size, E]
        except StateError:
            return gauge
        except CorruptRecordError as err:
            corrupt.add(err.key or str(err))
            return gauge
        planned = None if plan is None else plan.new_phy2log
        for label, phy2log in (("current", placement.phy2log), ("planned", planned)):
            if phy2log is not None:
                fraction = cross_node_fraction(stack, phy2log, cfg.ep_size, cfg.num_nodes)
                gauge.add_metric([label], float(fraction.mean()))
        return gauge

    def _member_gauges(self, rec, corrupt: set[str]):
        """Ranks per membership state (a missing member record as :func:`fdeplb.status.member_states` says) and the
        membership generation."""
        from fdeplb.machines.tables import MEMBERSHIP, MemberState
        from fdeplb.status import member_states

        counts = dict.fromkeys(MemberState, 0)
        for st in member_states(self.store, self.store.read_each(MEMBERSHIP)):
            if isinstance(st, CorruptRecordError):
                corrupt.add(st.key or str(st))
                continue
            counts[st] += 1
        ranks = GaugeMetricFamily("fdeplb_membership_ranks", "EP ranks per membership state", labels=["state"])
        for state, n in counts.items():
            ranks.add_metric([state.value], n)
        yield ranks
        if rec is not None:
            yield GaugeMetricFamily("fdeplb_membership_generation", "The cluster's membership generation (+1 at "
                                    "every membership transition)", value=rec.generation)
