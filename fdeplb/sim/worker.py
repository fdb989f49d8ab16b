"""A simulated serving worker: one OS process per EP rank, running a :class:`~fdeplb.orchestration.agent.RankAgent`.

``python -m fdeplb.sim.worker --redis-url URL --cluster ID --rank R --trace PATH`` loads the rank's live experts
from the cluster's checkpoint, then reconciles until SIGTERM/SIGINT, or, with ``--parent-pid PID`` (opt-in: the
demo and the tests pass their own pid), until that process is gone (checked every 0.5 s), so that such a worker never
outlives the demo or test that started it; a worker started in the background of a shell (``nohup ... &``) keeps
running when the shell exits. Its expert_load window is its share of the trace (see :mod:`fdeplb.sim.shares`). With
several ``--trace`` options, round n uses trace (n - 1) mod k: the load drifts between recorded workloads from round
to round.

Signals: SIGTERM / SIGINT are blocked from the start until the worker's own handlers are installed, after paddle is
imported (paddle installs handlers of its own on import, which abort, or deadlock, a process signalled mid-import);
a signal that arrived meanwhile is then handled by ours: the worker stops cleanly (exit 0).

Before it registers, the worker checks its arguments against the cluster: an argument error is one line on stderr
(``error: ...``) and the exit code of :func:`fdeplb.errors.exit_code`, as for ``fdeplb``: 2 an ``--rank`` outside
the cluster, an unknown cluster or a trace whose shape is not the cluster's [num_layers, num_logical_experts];
3 the rank is driven by a live agent (pass ``--replace`` to supersede it); 7 Redis did not answer within
``--redis-wait-s``.

``--step-ms MS``: the worker is an engine instead: an :class:`~fdeplb.orchestration.embedded_agent.EmbeddedAgent`
reconciles in the background and the main thread calls ``at_safe_point()`` every ``MS`` ms (a forward step), so
swaps (in chunks of layers) and weight changes apply at switch steps, as in a serving worker. With
``FDEPLB_FAILPOINTS=engine.hang=SIGUSR1`` (tests) that signal hangs the step loop and a second one resumes it,
while the agent's thread (heartbeats, staging) runs on: a hung engine (a forward step stuck in a kernel or a
collective), which SIGSTOP is not (it stops every thread, the heartbeat too).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from fdeplb.failpoints import failpoint, switch
from fdeplb.log import configure
from fdeplb.options import cluster_parent

#: the signals that stop a worker
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fdeplb.sim.worker", parents=[cluster_parent()])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--trace", required=True, action="append", help="expert-load dump; repeat to drift per round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--staging-budget-bytes", type=int, default=None)
    p.add_argument("--backend", choices=("paddle", "numpy"), default="paddle",
                   help="live experts as paddle tensors from the checkpoint, or numpy arrays (fdeplb.testing)")
    p.add_argument("--api-address", default=None, metavar="HOST:PORT",
                   help="the worker's API address, registered with the rank (the only addresses `ips` may name)")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="stop when this process is gone (opt-in; default: no parent watch)")
    p.add_argument("--replace", action="store_true",
                   help="supersede a live agent of the same rank (default: refuse, exit 3; an agent whose pid is "
                        "gone on this host is taken over without it)")
    p.add_argument("--redis-wait-s", type=float, default=300.0, help="wait this long for Redis at start-up")
    p.add_argument("--heartbeat-ttl-ms", type=int, default=10_000,
                   help="the heartbeat's time to live: the rank is stale this long after its last beat")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--step-ms", type=float, default=None,
                   help="run as an engine: a safe point every this many ms (an embedded agent); default: threaded")
    args = p.parse_args(argv)
    configure(args.log_level)
    stop = threading.Event()
    _import_with_our_signals(args.backend, stop)
    if stop.is_set():
        import structlog

        structlog.get_logger("fdeplb.agent").info("stopped before start", ep_rank=args.rank)
        return 0
    from fdeplb.errors import FdeplbError, exit_code

    try:
        return _serve(args, stop)
    except FdeplbError as err:  # an argument the cluster refuses, no cluster, no Redis: one line, its exit code
        print(f"error: {err}", file=sys.stderr, flush=True)
        return exit_code(err)


def _import_with_our_signals(backend: str, stop: threading.Event) -> None:
    """Import paddle (``backend == "paddle"``) with SIGTERM / SIGINT blocked, then install handlers that set
    ``stop`` and unblock them (a signal that came meanwhile is delivered to ours)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        if backend == "paddle":
            from fdeplb.weights import import_paddle

            import_paddle()  # paddle installs its own SIGTERM handler on import (it aborts): ours replace it below
        failpoint("worker.stop", "imported")  # tests: SIGSTOP here, signal, SIGCONT
    finally:
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda _signum, _frame: stop.set())
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _serve(args: argparse.Namespace, stop: threading.Event) -> int:
    from fdeplb.machines.tables import RANK
    import structlog

    from fdeplb.errors import InputError
    from fdeplb.orchestration.agent import RankAgent
    from fdeplb.placement import read_expert_load
    from fdeplb.sim.shares import rank_share
    from fdeplb.store import Store
    from fdeplb.testing import NumpyWeights

    store = Store(args.redis_url, args.cluster)
    store.wait_available(args.redis_wait_s, lambda err: structlog.get_logger("fdeplb.agent").warning(
        "waiting for redis", url=args.redis_url, timeout_s=args.redis_wait_s, error=err))
    config = store.read_config()
    if not 0 <= args.rank < config.ep_size:
        raise InputError(f"--rank {args.rank} is outside cluster {args.cluster!r}'s ranks 0..{config.ep_size - 1}")
    shape = (config.num_layers, config.num_logical_experts)
    loads = []
    for t in args.trace:
        load = read_expert_load(t).expert_load
        if load.shape != shape:  # before registering: a wrong trace must not take a rank over
            raise InputError(f"--trace {t} holds a load of {load.shape[0]} layers x {load.shape[1]} experts; "
                             f"cluster {args.cluster!r} has {shape[0]} x {shape[1]} (num_layers x "
                             f"num_logical_experts)")
        loads.append(load)
    windows = [rank_share(load, args.rank, config.ep_size, args.seed) for load in loads]
    kwargs = dict(load_source=lambda round_: windows[(round_ - 1) % len(windows)],
                  backend_factory=NumpyWeights.factory() if args.backend == "numpy" else None,
                  staging_budget_bytes=args.staging_budget_bytes, verify_all=True, replace=args.replace,
                  heartbeat_ttl_ms=args.heartbeat_ttl_ms)
    hang = switch("engine.hang")  # before the rank is ready: a test signals it only after rank_ready
    if args.step_ms is not None:
        from fdeplb.orchestration.embedded_agent import EmbeddedAgent

        agent = EmbeddedAgent(store, args.rank, block_ms=20, publish_interval_s=None, **kwargs)
    else:
        agent = RankAgent(store, args.rank, **kwargs)
    agent.stop_event = stop  # the signal handlers set it
    if args.parent_pid is not None:
        threading.Thread(target=watch_parent, args=(args.parent_pid, stop), daemon=True,
                         name="watch-parent").start()
    agent.start(info={"api_address": args.api_address} if args.api_address else None)
    # the live placement as loaded is verified too, not only after a swap: a round that is skipped or aborted
    # still reports how many slots hold exactly their expert (the demo's "verified" line)
    verified, total = agent.backend.verify()
    store.update(RANK, args.rank, slots_verified=verified, slots_total=total)
    store.emit_event("rank_verified", rank=args.rank, slots_verified=verified, slots_total=total)
    if args.step_ms is None:
        agent.run()
        return _stopped(agent, args.cluster)
    while not stop.wait(args.step_ms / 1000):  # the engine's forward steps (start() began the loop)
        if hang is not None and hang.is_set():
            _hang(hang, stop, store, args.rank)
        agent.at_safe_point()
    agent.close()
    return _stopped(agent, args.cluster)


def _stopped(agent: object, cluster: str) -> int:
    """The worker's exit once its agent stopped: 0; one line on stderr when an operator deleted the cluster."""
    if agent.deleted is not None:
        print(f"stopped: {agent.deleted.text(cluster)}", file=sys.stderr, flush=True)
    return 0


def _hang(hang: threading.Event, stop: threading.Event, store: object, ep_rank: int) -> None:
    """The ``engine.hang`` failpoint: hold the step loop while ``hang`` is set (until ``stop``), announced by a
    ``failpoint`` event when it begins and ends (tests wait on them)."""
    store.emit_event("failpoint", name="engine.hang", state="hung", rank=ep_rank)
    while hang.is_set() and not stop.wait(0.05):
        continue
    store.emit_event("failpoint", name="engine.hang", state="resumed", rank=ep_rank)


def watch_parent(parent: int, stop_event: threading.Event, period_s: float = 0.5, grace_s: float = 3.0) -> None:
    """Stop the agent when process ``parent`` is gone (this process was re-parented, or ``parent`` no longer
    exists); exit hard if the agent has not stopped ``grace_s`` seconds later."""
    started_by_parent = os.getppid() == parent
    while not stop_event.wait(period_s):
        if (os.getppid() != parent) if started_by_parent else not _alive(parent):
            # said at WARNING: a worker started in the background of a shell that then exits stops here, and
            # without this line its log would not say why (pass --parent-pid of a process that stays)
            import structlog

            structlog.get_logger("fdeplb.agent").warning(
                "parent process gone: stopping", parent_pid=parent,
                hint="--parent-pid names the process whose end stops this worker")
            stop_event.set()
            if not _exited.wait(grace_s):
                os._exit(1)
            return


_exited = threading.Event()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


if __name__ == "__main__":
    try:
        code = main()
    finally:
        _exited.set()
    sys.exit(code)
