"""``fdeplb round abort|cancel``, ``fdeplb config show|set`` and ``fdeplb cluster delete``: the operator's escape
hatches on a cluster (:mod:`fdeplb.orchestration.operator`), each audited with who ran it (``operator:<user>@<host>``)
and why (``--reason``). A command that cannot apply (no round in flight, past the commit point, no request pending,
a setting that may not change, agents alive) changes nothing and exits non-zero with one line saying why."""

from __future__ import annotations

import argparse
import dataclasses
import json

from fdeplb.cli._common import open_store
from fdeplb.cli.rank_cmd import operator_id
from fdeplb.options import audit_dir_parent, cluster_parent
from fdeplb.placement import POLICIES
from fdeplb.store import Deadlines

_DEADLINES = [f.name for f in dataclasses.fields(Deadlines)]


def deadline_flags(name: str) -> list[str]:
    """The option strings of deadline ``name`` (``collecting_ms`` -> ``--collecting-ms``; ``request_ttl_ms`` also
    ``--request-ttl``), shared by ``init-cluster`` and ``config set``."""
    flag = "--" + name.replace("_", "-")
    return [flag, flag.removesuffix("-ms")] if name == "request_ttl_ms" else [flag]


def register(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("round", help="the round in flight or pending: abort, cancel",
                       description="End a rearrangement round as an operator, audited with who and why.")
    cmds = r.add_subparsers(dest="round_command", metavar="COMMAND")
    cmds.required = True
    a = cmds.add_parser("abort", parents=[cluster_parent()],
                        help="abort the round in flight (before the commit point; refused after it)",
                        description="Abort the round in flight (COLLECTING, PLANNING, LOADING or LOAD_SUCC): the old "
                                    "placement stays, the ranks drop their staging. Refused (exit 3) once the round "
                                    "is past the commit point (SWAPPING, DONE): it then rolls forward.")
    a.add_argument("--reason", default="", help="why (kept in the audit record)")
    a.set_defaults(handler=run_abort)
    c = cmds.add_parser("cancel", parents=[cluster_parent()], help="withdraw a pending round request",
                        description="Withdraw the round request that has not started yet (e.g. one waiting for a "
                                    "stale rank); it never starts. Exit 3 when none is pending.")
    c.add_argument("--reason", default="", help="why (kept in the audit record)")
    c.set_defaults(handler=run_cancel)

    cf = sub.add_parser("config", help="show or change a cluster's settings",
                        description="Show the cluster's configuration, or change the settings that may change on "
                                    "a running cluster (policy, min_gain, cordoned, retention, deadlines): the "
                                    "configuration's version goes up by one and the change is audited. The "
                                    "coordinator applies it from the next round.")
    ccmds = cf.add_subparsers(dest="config_command", metavar="COMMAND")
    ccmds.required = True
    show = ccmds.add_parser("show", parents=[cluster_parent()], help="print the configuration as JSON")
    show.set_defaults(handler=run_show)
    s = ccmds.add_parser("set", parents=[cluster_parent(), audit_dir_parent()],
                         help="change settings (audited, version + 1)")
    s.add_argument("--policy", choices=tuple(POLICIES), default=None)
    s.add_argument("--min-gain", type=float, default=None, help="least balancedness gain worth a round, in [0, 1]")
    s.add_argument("--cordoned", action=argparse.BooleanOptionalAction, default=None,
                   help="commit only on an external request (--no-cordoned: commit on their own)")
    s.add_argument("--retain-rounds", type=int, default=None)
    s.add_argument("--audit-keep", type=int, default=None)
    s.add_argument("--audit-export", default=None, metavar="FILE",
                   help="JSONL file older audit records go to before trimming: a regular file inside --audit-dir "
                        "(only the command line sets it, never the API)")
    for name in _DEADLINES:
        s.add_argument(*deadline_flags(name), dest=name, type=int, default=None, metavar="MS",
                       help=f"deadlines.{name}")
    s.add_argument("--reason", default="", help="why (kept in the audit record)")
    s.set_defaults(handler=run_set)

    cl = sub.add_parser("cluster", help="delete a cluster's keys",
                        description="Remove a cluster from Redis.")
    clcmds = cl.add_subparsers(dest="cluster_command", metavar="COMMAND")
    clcmds.required = True
    d = clcmds.add_parser("delete", parents=[cluster_parent()], help="delete every key of the cluster",
                          description="Delete every key of the cluster (configuration, records, audit, plans, "
                                      "snapshots, lease), leaving a tombstone (an hour) in the same transaction. "
                                      "Refused (exit 3) while a rank's heartbeat is fresh or a coordinator holds the "
                                      "lease, unless --force.")
    d.add_argument("--force", action="store_true",
                   help="delete even while agents or a coordinator are alive: they find the tombstone and stop")
    d.add_argument("--no-tombstone", action="store_true",
                   help="leave no key at all (a clean-up after every process of the cluster has ended, as the demo's "
                        "reaper does): a process still running then finds no cluster instead of a delete")
    d.set_defaults(handler=run_delete)


def run_abort(args: argparse.Namespace) -> int:
    from fdeplb.orchestration.operator import abort_round

    fired = abort_round(open_store(args.redis_url, args.cluster), by=operator_id(), reason=args.reason)
    print(f"round {fired.before.round}: aborted from {fired.before.state} ({fired.after.reason})")
    return 0


def run_cancel(args: argparse.Namespace) -> int:
    from fdeplb.orchestration.operator import cancel_request

    withdrawn, dropped = cancel_request(open_store(args.redis_url, args.cluster), by=operator_id(),
                                        reason=args.reason)
    print(f"round {withdrawn}: request withdrawn" + (f", with the operator's plan {dropped} that waited for it"
                                                     if dropped else ""))
    return 0


def run_show(args: argparse.Namespace) -> int:
    print(json.dumps(open_store(args.redis_url, args.cluster).read_config().to_json(), indent=2, sort_keys=True))
    return 0


def settings_of(args: argparse.Namespace) -> dict:
    """The settings ``config set`` was given (None = not given), in :meth:`ClusterConfig.with_settings`' form."""
    flat = {"policy": args.policy, "min_gain": args.min_gain, "cordoned": args.cordoned,
            "retain_rounds": args.retain_rounds, "audit_keep": args.audit_keep, "audit_export_path": args.audit_export}
    changes = {k: v for k, v in flat.items() if v is not None}
    deadlines = {name: getattr(args, name) for name in _DEADLINES if getattr(args, name) is not None}
    if deadlines:
        changes["deadlines"] = deadlines
    return changes


def run_set(args: argparse.Namespace) -> int:
    from fdeplb.errors import InputError
    from fdeplb.orchestration.operator import change_settings

    changes = settings_of(args)
    if not changes:
        raise InputError("nothing to change: give at least one setting (see fdeplb config set --help)")
    old, new = change_settings(open_store(args.redis_url, args.cluster), changes, by=operator_id(),
                               reason=args.reason, audit_dir=args.audit_dir)
    if new.version == old.version:
        print(f"cluster {args.cluster}: settings already as given (version {new.version})")
    else:
        print(f"cluster {args.cluster}: settings changed, version {old.version} -> {new.version}; applied from the "
              f"next round")
    return 0


def run_delete(args: argparse.Namespace) -> int:
    from fdeplb.orchestration.operator import delete_cluster

    by = "" if args.no_tombstone else operator_id()  # no operator named: no tombstone
    n = delete_cluster(open_store(args.redis_url, args.cluster), force=args.force, by=by)
    print(f"cluster {args.cluster}: deleted {n} keys (by {operator_id()}{', no tombstone' if not by else ''})")
    return 0
