"""``fdeplb demo``: one full rearrangement round of a simulated cluster on a real expert-load dump."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys

from fdeplb.errors import InputError
from fdeplb.machines.tables import ClusterState
from fdeplb.placement import POLICIES
from fdeplb.sim.demo_driver import DemoOptions

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DemoOptions)}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run one expert rearrangement of a simulated cluster on a real trace",
                       description=__doc__)
    p.add_argument("--trace", required=True, help="expert-load dump (SGLang logical_count JSON or counts JSON)")
    p.add_argument("--ranks", type=int, default=_DEFAULTS["ranks"], help="EP ranks = worker processes "
                   "(default %(default)s)")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of the embedded one")
    p.add_argument("--policy", default=_DEFAULTS["policy"], choices=tuple(POLICIES),
                   help="placement policy (default %(default)s)")
    p.add_argument("--num-redundant-experts", type=int, default=None)
    p.add_argument("--num-groups", type=int, default=None)
    p.add_argument("--num-nodes", type=int, default=_DEFAULTS["num_nodes"])
    p.add_argument("--timeout", type=float, default=_DEFAULTS["timeout_s"],
                   help="seconds a phase may take (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print a machine-readable summary as the last line")
    p.add_argument("--keep", action="store_true",
                   help="keep the checkpoint and worker logs (and, with --redis-url, the cluster's keys)")
    p.add_argument("--log-level", default="WARNING")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from fdeplb.log import configure
    from fdeplb.sim.demo_driver import run_demo
    from fdeplb.weights import import_paddle

    if args.ranks < 1:
        raise InputError(f"--ranks must be >= 1, got {args.ranks}")
    configure(args.log_level)
    import_paddle()  # paddle's own SIGTERM handler aborts the process; ours unwinds so the workers are stopped

    def terminate(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    summary = run_demo(DemoOptions(
        trace=args.trace, ranks=args.ranks, redis_url=args.redis_url, policy=args.policy,
        num_redundant_experts=args.num_redundant_experts, num_groups=args.num_groups, num_nodes=args.num_nodes,
        timeout_s=args.timeout, keep=args.keep,
    ))
    ok = (summary["done_then_free"] and summary["final_state"] == ClusterState.FREE
          and summary["slots_verified"] == summary["slots_total"])
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    sys.stdout.flush()
    return 0 if ok else 1
