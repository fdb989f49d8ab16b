"""``fdeplb coordinator`` (the sidecar that drives a cluster) and ``fdeplb rearrange`` (ask for a round)."""

from __future__ import annotations

import argparse
import signal


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("coordinator", help="run a coordinator for a cluster (one leads, others stand by)",
                       description="Run a coordinator next to the workers. Several may run: one holds the lease "
                                   "and drives the cluster machine, the others take over when its lease lapses.")
    p.add_argument("--redis-url", required=True)
    p.add_argument("--cluster", required=True)
    p.add_argument("--holder", default=None, help="holder id (default coordinator@host:pid:random)")
    p.add_argument("--lease-ms", type=int, default=3_000, help="lease time to live in ms (default 3000)")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(handler=run_coordinator)

    r = sub.add_parser("rearrange", help="ask the cluster's coordinator for one rearrangement round",
                       description="Request a rearrangement round (FastDeploy's rearrange_experts), or with "
                                   "--commit PLAN_ID allow a cordoned cluster's staged plan to commit.")
    r.add_argument("--redis-url", required=True)
    r.add_argument("--cluster", required=True)
    r.add_argument("--commit", metavar="PLAN_ID", default=None)
    r.add_argument("--reason", default="operator")
    r.set_defaults(handler=run_rearrange)


def run_coordinator(args: argparse.Namespace) -> int:
    from fdeplb.cli._common import open_store
    from fdeplb.log import configure
    from fdeplb.orchestration.coordinator import Coordinator

    configure(args.log_level)
    store = open_store(args.redis_url, args.cluster)
    coordinator = Coordinator(store, args.holder, lease_ms=args.lease_ms)

    def stop(_signum, _frame):
        coordinator.stop_event.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    coordinator.run()
    return 0


def run_rearrange(args: argparse.Namespace) -> int:
    from fdeplb.cli._common import open_store
    from fdeplb.orchestration.cluster import request_commit, request_round

    store = open_store(args.redis_url, args.cluster)
    if args.commit:
        request_commit(store, args.commit)
        print(f"commit of plan {args.commit} requested")
    else:
        print(f"round requested ({request_round(store, args.reason)} requested so far)")
    return 0
