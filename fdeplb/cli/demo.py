"""``fdeplb demo``: one full rearrangement round of a simulated cluster on a real expert-load dump."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys

from fdeplb.placement import POLICIES
from fdeplb.sim.demo_driver import DemoOptions

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DemoOptions)}

DESCRIPTION = """\
Run one expert rearrangement of a simulated cluster, end to end: an embedded Redis, one worker process per EP rank
holding real paddle expert tensors (a tiny checkpoint with the trace's layer and expert counts), a coordinator, one
round (collect the ranks' loads, plan, stage, swap), then every slot verified against the checkpoint.

Without --trace it runs on the real DeepSeek-V3 expert-load dump bundled in the package (SGLang's published EP
statistics). Exit status: 0 when the round rearranged or was skipped (nothing worth moving) and every live slot
verified; 1 when it aborted or a slot did not verify; 130/143 when interrupted (Ctrl-C / SIGTERM).
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run one expert rearrangement of a simulated cluster on a real trace",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="expert-load dump (SGLang logical_count JSON or counts JSON); default: the bundled "
                        "DeepSeek-V3 dump")
    p.add_argument("--ranks", type=int, default=_DEFAULTS["ranks"], help="EP ranks = worker processes "
                   "(default %(default)s)")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of the embedded one")
    p.add_argument("--policy", default=_DEFAULTS["policy"], choices=tuple(POLICIES), metavar="POLICY",
                   help=f"placement policy: {', '.join(POLICIES)} (default %(default)s)")
    p.add_argument("--num-redundant-experts", type=int, default=None,
                   help="extra slots for replicas of hot experts (default: the least >= experts/8 that splits "
                        "evenly over the ranks)")
    p.add_argument("--num-groups", type=int, default=None,
                   help="expert groups (default 8 for 256 experts, as DeepSeek-V3; else 1)")
    p.add_argument("--num-nodes", type=int, default=_DEFAULTS["num_nodes"], help="nodes (default %(default)s)")
    p.add_argument("--timeout", type=float, default=_DEFAULTS["timeout_s"],
                   help="seconds a phase may take (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print a machine-readable summary as the last line")
    p.add_argument("--verbose", action="store_true", help="print every audit record, not only the first and last")
    p.add_argument("--keep", action="store_true",
                   help="keep the checkpoint and worker logs (and, with --redis-url, the cluster's keys)")
    p.add_argument("--export-audit", default=None, metavar="FILE",
                   help="write the round's recording (as `fdeplb audit --export`) to FILE for `fdeplb replay`")
    p.add_argument("--log-level", default="WARNING", help="log level of the demo process (default %(default)s)")
    p.set_defaults(handler=run)


class Interrupted(KeyboardInterrupt):
    """The demo was asked to stop (SIGINT or SIGTERM); ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _install_interrupt_handlers() -> None:
    """The first SIGINT/SIGTERM raises :class:`Interrupted` in the main thread (the demo unwinds: workers, Redis
    and temp dirs are cleaned up); every later one is ignored so that nothing cuts that clean-up short."""

    def first(signum, _frame):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, first)


def run(args: argparse.Namespace) -> int:
    from fdeplb.log import configure
    from fdeplb.sim.demo_driver import run_demo
    from fdeplb.weights import import_paddle

    from fdeplb.cli._common import check_out_folder

    check_out_folder("--export-audit", args.export_audit)  # not after a whole round
    configure(args.log_level)
    import_paddle()  # paddle's own SIGTERM handler aborts the process; ours (installed after) unwinds cleanly
    _install_interrupt_handlers()
    try:
        summary = run_demo(DemoOptions(
            trace=args.trace, ranks=args.ranks, redis_url=args.redis_url, policy=args.policy,
            num_redundant_experts=args.num_redundant_experts, num_groups=args.num_groups, num_nodes=args.num_nodes,
            timeout_s=args.timeout, keep=args.keep, verbose=args.verbose,
            export_audit=args.export_audit,
        ), emit=lambda line: print(line, flush=True))
    except Interrupted as exc:
        print(f"fdeplb demo: interrupted by {signal.Signals(exc.signum).name}; workers and Redis stopped, "
              f"temporary files removed", file=sys.stderr, flush=True)
        return 128 + exc.signum
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
    ok = summary["outcome"] in ("rearranged", "skipped") and summary["slots_verified"] == summary["slots_total"]
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    sys.stdout.flush()
    return 0 if ok else 1
