"""What the orchestration tests share (and the CLI's and API's tests over a thread cluster): the round-done
predicate, thread clusters that lost rank 3 (:func:`lose_rank3`) or probe (:func:`probed_cluster`), the
embedded-worker threads (:class:`Workers`) with an instrumented backend, the weight-cancel cluster
(:func:`embedded`), the kill of rank 1 between two chunks, and a paddle-backed serving cluster
(:func:`paddle_serving`) with its rounds' loads (:func:`new_load`)."""

from __future__ import annotations

import contextlib
import signal
import threading

import numpy as np

from fdeplb.machines.tables import MEMBERSHIP, ClusterState, MemberState
from fdeplb.orchestration.agent import RankAgent
from fdeplb.orchestration.embedded_agent import EmbeddedAgent
from fdeplb.store import Deadlines
from fdeplb.testing import NumpyWeights
from tests.faults.helpers import wait_event
from tests.helpers import thread_cluster, wait_for


def round_done(store, n):
    rec = store.read_cluster()
    return rec.state is ClusterState.FREE and rec.round >= n and rec


class Instrumented(NumpyWeights):
    """Records, for every change of the live slots, whether it ran inside at_safe_point and in which thread."""

    agent: RankAgent | None = None

    def __init__(self, *args, **kwargs):
        self.changes: list[tuple[str, bool, str]] = []
        super().__init__(*args, **kwargs)

    def _note(self, what):
        if self.agent is not None:
            self.changes.append((what, self.agent.switch._in_safe_point, threading.current_thread().name))

    def swap(self, staged, new, live_ranks=None):
        self._note("swap")
        return super().swap(staged, new, live_ranks)

    def swap_layers(self, staged, new, layers):  # a chunk of a swap (embedded agents)
        self._note("swap")
        return super().swap_layers(staged, new, layers)

    def clear(self):
        self._note("clear")
        return super().clear()

    def reload_in(self, phy2log):
        self._note("reload_in")
        return super().reload_in(phy2log)


class Workers:
    """One thread per rank, in lockstep (a barrier per step: the all-to-all), each calling record() and
    at_safe_point(); rank ``slow`` takes longer per step and its agent looks at Redis less often."""

    def __init__(self, agents, loads, slow=None):
        self.agents, self.loads, self.slow = agents, loads, slow
        self.stop = threading.Event()
        self.barrier = threading.Barrier(len(agents))
        self.placements: list[list[bytes]] = [[] for _ in agents]  # per rank, per step: live phy2log bytes
        self.threads = [threading.Thread(target=self.work, args=(r,), name=f"worker{r}", daemon=True)
                        for r in range(len(agents))]

    def work(self, r):
        agent = self.agents[r]
        agent.backend.agent = agent
        while not self.stop.is_set():
            try:
                self.barrier.wait(timeout=30)
            except threading.BrokenBarrierError:
                return
            if agent.serving:
                agent.record(self.loads[r])
            if r == self.slow:
                self.stop.wait(0.01)
            agent.at_safe_point()
            self.placements[r].append(agent.backend.phy2log.tobytes() if agent.serving else b"cleared")

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.barrier.abort()
        for t in self.threads:
            t.join(10)


def kill_rank1_between_chunks(cluster, store, coordinator_thread: threading.Thread, args: tuple[str, ...],
                              reason: str) -> dict:
    """Start the 4 workers of ``cluster`` (rank 1 hangs at its second chunk: failpoint ``rank.chunk.hang=2``), then
    the coordinator, request a round and SIGKILL rank 1's worker once it hangs there: the failpoint's event."""
    for r in range(4):
        cluster.start_rank(r, *args, env={"FDEPLB_FAILPOINTS": "rank.chunk.hang=2"} if r == 1 else None)
    cluster.wait_ready(timeout_s=120)
    coordinator_thread.start()
    cursor = store.cursor()
    store.request_round(reason)
    hit = wait_event(store, cursor, kind="failpoint", name="rank.chunk.hang", rank=1)
    cluster.kill_rank(1, signal.SIGKILL)
    return hit


#: a short weights deadline, the others long (only the weight request may time out)
CANCEL_DEADLINES = Deadlines(collecting_ms=20_000, loading_ms=20_000, commit_ms=20_000, swapping_ms=20_000,
                             weights_ms=300)


@contextlib.contextmanager
def embedded(tc, serving):
    """Embedded agents for every rank (they arm and switch at safe points); the workers of ``serving`` ranks run a
    serving loop (one safe point per step), the others never reach a safe point. Yields (agents, start(rank)): the
    latter starts a stopped worker's loop later."""
    agents = [EmbeddedAgent(tc.store(), r, backend_factory=NumpyWeights.factory(), publish_interval_s=None,
                            block_ms=50).start() for r in range(tc.config.ep_size)]
    stop = threading.Event()
    threads = []

    def worker(agent):
        while not stop.is_set():
            agent.at_safe_point()
            stop.wait(0.01)

    def start(r):
        t = threading.Thread(target=worker, args=(agents[r],), daemon=True)
        t.start()
        threads.append(t)

    try:
        for r in serving:
            start(r)
        yield agents, start
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        for a in agents:
            a.close()


def new_load(tc, n, store=None):
    """Round n's load: the experts' loads rolled by 5 * n (in place: the workers record tc.loads), so every round
    plans a placement that gains over the last one; with ``store``, returns once every rank stepped 5 more times
    with it (recorded, as the round's window will be)."""
    tc.loads[...] = np.roll(tc.base_loads, 5 * n, axis=-1)
    if store is not None:
        steps = [store.read_rank(r).step for r in range(tc.config.ep_size)]
        wait_for(lambda: all(store.read_rank(r).step >= s + 5 for r, s in enumerate(steps)), 30, store,
                 "five steps with the new load")


@contextlib.contextmanager
def paddle_serving(redis_url, cluster_id, tmp_path, setup=None, num_layers=4, **agent_kw):
    """A paddle-backed thread cluster of ``num_layers`` layers, one EmbeddedAgent per rank (``agent_kw``; default one changed
    layer per safe point, every slot verified after a swap), ``setup(agents)`` called before the coordinator
    starts, a coordinator and the workers stepping: yields ``(tc, store, agents)``."""
    agent_kw = {"max_pause_bytes": 1, "verify_all": True, **agent_kw}
    with thread_cluster(redis_url, cluster_id, tmp_path, num_layers=num_layers, backend="paddle") as tc:
        agents = [EmbeddedAgent(tc.store(), r, device="cpu", block_ms=50, publish_interval_s=None,
                                **agent_kw).start() for r in range(tc.config.ep_size)]
        if setup is not None:
            setup(agents)
        tc.base_loads = tc.loads.copy()
        tc.start_coordinator()
        store = tc.store()
        try:
            with Workers(agents, tc.loads):
                wait_for(lambda: all(store.read_rank(r).step > 0 for r in range(4)), 30, store, "step reports")
                yield tc, store, agents
        finally:
            for a in agents:
                a.close()


#: the membership tests' heartbeat TTL (heartbeats every 0.1 s)
TTL = 400


def deadlines(**kw) -> Deadlines:
    """The membership tests' deadlines: 20 s per phase, a lost rank excluded after 1 s (``kw`` overrides)."""
    return Deadlines(**{"collecting_ms": 20_000, "loading_ms": 20_000, "commit_ms": 20_000, "swapping_ms": 20_000,
                        "exclude_ms": 1_000, **kw})


def kill(tc, r: int) -> None:
    """Stop rank ``r``'s agent thread of thread cluster ``tc`` (as if its worker died) and wait for it."""
    tc.agents[r].stop_event.set()
    tc.threads[r].join(10)
    assert not tc.threads[r].is_alive()


def lose_rank3(redis_url, cluster_id, tmp_path):
    """A 4-rank thread cluster (2 layers x 8 experts, 4 redundant, :func:`deadlines`) whose rank 3 was lost: EXCLUDED
    and its re-placement round (round 1) done. A context manager: ``(tc, store)``."""
    @contextlib.contextmanager
    def cm():
        with thread_cluster(redis_url, cluster_id, tmp_path, num_layers=2, num_experts=8, num_redundant=4,
                            deadlines=deadlines()) as tc:
            store = tc.store()
            tc.start(heartbeat_ttl_ms=TTL)
            kill(tc, 3)
            wait_for(lambda: store.read(MEMBERSHIP, 3).state is MemberState.EXCLUDED, 30, store, "rank 3 excluded")
            wait_for(lambda: round_done(store, 1), 60, store, "the re-placement round")
            yield tc, store
    return cm()


@contextlib.contextmanager
def probed_cluster(redis_url, cluster_id, tmp_path, probe_of):
    """A thread cluster whose agents registered ``probe_of(ep_rank)`` as their output probe before the coordinator
    started (yields it)."""
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        tc.start_agents()
        for a in tc.agents:
            a.set_probe(probe_of(a.ep_rank))
        tc.start_coordinator()
        yield tc


def round_over(store, n):
    """A predicate: round ``n`` is over (the cluster FREE at round >= n, every rank IDLE)."""
    def check():
        rec = store.read_cluster()
        return rec.state is ClusterState.FREE and rec.round >= n and all(
            store.read_rank(r).state == "IDLE" for r in range(store.ep_size()))
    return check


def transitions_of(store, machine="cluster"):
    """(from, to, trigger) of every audited transition of ``machine``."""
    return [(a["from"], a["to"], a["trigger"]) for a in store.iter_audit() if a["machine"] == machine]
