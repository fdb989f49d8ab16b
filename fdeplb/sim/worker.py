"""A simulated serving worker: one OS process per EP rank, running a :class:`~fdeplb.orchestration.agent.RankAgent`.

``python -m fdeplb.sim.worker --redis-url URL --cluster ID --rank R --trace PATH`` loads the rank's live experts
from the cluster's checkpoint, then reconciles until SIGTERM/SIGINT, or until its parent process is gone (``--parent-pid``, default the
process that started it; checked every 0.5 s): a worker never outlives the demo or test that started it. Its expert_load window is its share of the
trace (see :mod:`fdeplb.sim.shares`). With several ``--trace`` options, round n uses trace (n - 1) mod k: the load
drifts between recorded workloads from round to round.

``--step-ms MS``: the worker is an engine instead: an :class:`~fdeplb.orchestration.embedded_agent.EmbeddedAgent`
reconciles in the background and the main thread calls ``at_safe_point()`` every ``MS`` ms (a forward step), so
swaps (in chunks of layers) and weight changes apply at switch steps, as in a serving worker.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from fdeplb.log import configure
from fdeplb.options import cluster_parent


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
                   help="stop when this process is gone (default: the process that started this one)")
    p.add_argument("--redis-wait-s", type=float, default=300.0, help="wait this long for Redis at start-up")
    p.add_argument("--heartbeat-ttl-ms", type=int, default=10_000,
                   help="the heartbeat's time to live: the rank is stale this long after its last beat")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--step-ms", type=float, default=None,
                   help="run as an engine: a safe point every this many ms (an embedded agent); default: threaded")
    args = p.parse_args(argv)
    parent = args.parent_pid or os.getppid()
    configure(args.log_level)

    from fdeplb.machines.tables import RANK
    import structlog

    from fdeplb.orchestration.agent import RankAgent
    from fdeplb.placement import read_expert_load
    from fdeplb.sim.shares import rank_share
    from fdeplb.store import Store
    from fdeplb.testing import NumpyWeights
    from fdeplb.weights import import_paddle

    store = Store(args.redis_url, args.cluster)
    store.wait_available(args.redis_wait_s, lambda err: structlog.get_logger("fdeplb.agent").warning(
        "waiting for redis", url=args.redis_url, timeout_s=args.redis_wait_s, error=err))
    ep_size = store.ep_size()
    windows = [rank_share(read_expert_load(t).expert_load, args.rank, ep_size, args.seed) for t in args.trace]
    kwargs = dict(load_source=lambda round_: windows[(round_ - 1) % len(windows)],
                  backend_factory=NumpyWeights.factory() if args.backend == "numpy" else None,
                  staging_budget_bytes=args.staging_budget_bytes, verify_all=True,
                  heartbeat_ttl_ms=args.heartbeat_ttl_ms)
    if args.step_ms is not None:
        from fdeplb.orchestration.embedded_agent import EmbeddedAgent

        agent = EmbeddedAgent(store, args.rank, block_ms=20, publish_interval_s=None, **kwargs)
    else:
        agent = RankAgent(store, args.rank, **kwargs)

    def stop(_signum, _frame):
        agent.stop_event.set()

    if args.backend == "paddle":
        import_paddle()  # paddle installs its own SIGTERM handler on import (it aborts): import first, then ours
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    threading.Thread(target=watch_parent, args=(parent, agent.stop_event), daemon=True,
                     name="watch-parent").start()
    agent.start(info={"api_address": args.api_address} if args.api_address else None)
    # the live placement as loaded is verified too, not only after a swap: a round that is skipped or aborted
    # still reports how many slots hold exactly their expert (the demo's "verified" line)
    verified, total = agent.backend.verify()
    store.update(RANK, args.rank, slots_verified=verified, slots_total=total)
    store.emit_event("rank_verified", rank=args.rank, slots_verified=verified, slots_total=total)
    if args.step_ms is None:
        agent.run()
        return 0
    while not agent.stop_event.wait(args.step_ms / 1000):  # the engine's forward steps (start() began the loop)
        agent.at_safe_point()
    agent.close()
    return 0


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
