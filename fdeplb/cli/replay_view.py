"""``fdeplb replay``: replay a recording (``fdeplb audit --export``) through the machine tables, with no Redis.

Every transition, fence, guard and chain is checked and every plan recomputed from its snapshot
(:mod:`fdeplb.replay`); ``--until`` stops at a record, ``--into`` rebuilds the records in a Redis, ``--policy``
replans every round with another policy (what-if). Exit 0 when it replays, 1 on a mismatch (naming the first bad
line), 2 on a usage error. Nothing is written to Redis but by ``--into`` (into a new cluster id).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from fdeplb.cli._common import open_store
from fdeplb.errors import InputError
from fdeplb.machines.tables import TABLE_OF_LABEL
from fdeplb.options import cluster_parent


def register(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("replay", help="replay a recording through the machine tables, with no Redis",
                       description="Replay a recording (`fdeplb audit --export`) with no Redis: every record must "
                                   "follow from the ones before it (from-state, trigger, to-state, version, fence, "
                                   "the guards across records, the audit chain) and every plan, and every gated "
                                   "round's numbers, must reproduce from its snapshot. With --redis-url and "
                                   "--cluster the plans are checked against that live Redis instead, and the "
                                   "recording's last chain against its audit (the head, when the recording ends "
                                   "at the stream's end); with --into, "
                                   "--cluster names the cluster to rebuild. Exit 0 when it replays, 1 on a mismatch "
                                   "naming the first bad line, 2 on a usage error.",
                       parents=[cluster_parent(required=False)])
    r.add_argument("file", type=Path, metavar="FILE.jsonl", help="recording written by `fdeplb audit --export`")
    r.add_argument("--until", default=None, metavar="VERSION|ID",
                   help="stop after the audit record with this id, or the cluster record's transition to this "
                        "version, and print every machine's state there")
    r.add_argument("--policy", default=None, metavar="NAME",
                   help="what-if: replan every recorded round's snapshot with this policy and compare it with the "
                        "recorded plan (balancedness, moved experts)")
    r.add_argument("--into", default=None, metavar="REDIS_URL",
                   help="rebuild the replayed records in this Redis under --cluster (refused if it exists)")
    r.add_argument("--json", action="store_true", help="print the report as one JSON object")
    r.add_argument("--ui", action="store_true",
                   help="serve the recording player (the /ui page over this recording: a slider and next / "
                        "previous through its records, every failed check marked) on 127.0.0.1 and print its URL; "
                        "runs until interrupted")
    r.add_argument("--port", type=int, default=8765, help="port of --ui (default %(default)s; 0: any free port)")
    r.set_defaults(handler=run_replay)


def run_replay(args: argparse.Namespace) -> int:
    from fdeplb.replay import ReplayError, check_gates, check_plans, rebuild, replay_file, whatif
    from fdeplb.replay.anchor import check_head
    from fdeplb.replay.verify import check_recording
    from fdeplb.store import Store

    if args.ui:
        return serve_player(args)

    if args.into is not None and args.redis_url is not None:
        raise InputError("--into (rebuild into a Redis) and --redis-url (check against a live one) exclude each "
                         "other")
    if (args.into is not None or args.redis_url is not None) != (args.cluster is not None):
        raise InputError("--cluster goes with --into or --redis-url (the cluster to rebuild or check against)")
    into = Store(args.into, args.cluster) if args.into is not None else None  # a bad URL or id: before replaying
    if args.redis_url is None:
        report = check_recording(args.file, args.until)
    else:
        report = replay_file(args.file, args.until)
        if report.records == 0:
            raise ReplayError(f"{args.file}: no audit records (a recording has one JSON object per line)")
        live = open_store(args.redis_url, args.cluster)
        check_plans(live, report)
        check_head(live, report)
        if report.header is not None:
            check_gates(report)
    rows = whatif(report, args.policy) if args.policy is not None else None
    written = rebuild(report, into) if into is not None else None
    if args.json:
        out = report.to_json()
        if rows is not None:
            out["whatif"] = rows
        if written is not None:
            out["rebuilt"] = {"redis_url": args.into, "cluster": args.cluster, "audit_records": written}
        print(json.dumps(out, sort_keys=True))
        return 0
    if args.until is not None:
        print(f"state after {args.until}:")
    for key, ks in sorted(_states(report).items(), key=lambda kv: _key_order(kv[0])):
        print(f"{key:<12} {ks['state']} [{ks['code']}]  v{ks['version']}  ({ks['transitions']} transitions"
              f"{', last ' + ks['last_trigger'] if ks['last_trigger'] else ''})")
    if report.header is None and args.redis_url is None:
        plans = f", {len(report.plans)} plans (no header: pass --redis-url and --cluster to recompute them)"
    else:
        plans = f", {len(report.plans_checked)} plans recomputed and identical"
        if report.plans_unchecked:
            plans += f", {len(report.plans_unchecked)} pruned before the export (not checked)"
        if report.gates_checked:
            plans += f", {len(report.gates_checked)} gated rounds recomputed and identical"
    if report.head:
        plans += f"; live audit: {_HEAD_TEXT.get(report.head, report.head)}"
    chain = f", chain verified over {report.chained} records" if report.chained else ", no chain (old export)"
    print(f"replay OK: {report.transitions} transitions of {len(report.final)} records, "
          f"{report.skipped} notes (alarms, skips, start refusals){chain}{plans}")
    if rows is not None:
        print_whatif(rows, sys.stdout)
    if written is not None:
        print(f"rebuilt cluster {args.cluster} at {args.into}: {written} audit records")
    return 0


def serve_player(args: argparse.Namespace) -> int:
    """``--ui``: the player of ``args.file`` on 127.0.0.1:``args.port`` (uvicorn), its URL printed first. The
    recording is read and checked once, before the server starts (a file that does not parse: exit 1)."""
    import socket

    from fdeplb.errors import DependencyError

    others = [name for name, on in (("--until", args.until), ("--policy", args.policy), ("--into", args.into),
                                    ("--redis-url", args.redis_url), ("--json", args.json)) if on]
    if others:
        raise InputError(f"--ui plays the whole recording on its own; drop {', '.join(others)}")
    if not 0 <= args.port < 65536:
        raise InputError(f"--port must be in 0..65535, got {args.port}")
    try:
        import uvicorn

        from fdeplb.api.routes import create_player_app
    except ImportError as exc:
        raise DependencyError(f"fdeplb replay --ui needs the api extra: pip install 'fdeplb[api]' ({exc})") from None
    from fdeplb.ui import PlayerModel

    player = PlayerModel(args.file)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", args.port))
        sock.listen(128)  # listening before the URL is printed: a browser opening it at once waits in the backlog
    except OSError as exc:
        sock.close()
        raise InputError(f"cannot listen on 127.0.0.1:{args.port}: {exc.strerror}") from None
    port = sock.getsockname()[1]
    print(f"recording player of {args.file} ({len(player.records)} records; {player.checks['summary']})")
    print(f"open http://127.0.0.1:{port}/ui", flush=True)
    server = uvicorn.Server(uvicorn.Config(create_player_app(player), log_config=None, access_log=False,
                                           log_level="warning"))
    server.run(sockets=[sock])
    return 0


#: what check_head found, as the summary line says it
_HEAD_TEXT = {"matches": "the recording's last chain is the live audit head",
              "matches record": "the live record at the recording's end has its chain (the stream went on)",
              "trimmed": "not compared (the live audit was trimmed past the recording's end)",
              "no chain": "not compared (the recording has no chain)"}


def _states(report) -> dict[str, dict[str, Any]]:
    """Every machine's state where the replay stopped: the replayed ones, and the header's start for the others."""
    out: dict[str, dict[str, Any]] = {}
    for key, held in ((report.header or {}).get("start") or {}).get("records", {}).items():
        table = TABLE_OF_LABEL[key.partition(":")[0]]
        out[key] = {"state": held["state"], "code": table.to_code(held["state"]), "version": int(held["version"]),
                    "transitions": 0, "last_trigger": ""}
    for key, ks in report.final.items():
        out[key] = {"state": ks.state, "code": ks.code, "version": ks.version, "transitions": ks.transitions,
                    "last_trigger": ks.last_trigger}
    return out


def print_whatif(rows: list[dict[str, Any]], out: TextIO) -> None:
    """The what-if rows as a table: per round, balancedness and moved experts of the recorded plan and the new."""
    if not rows:
        out.write("what-if: no round of the recording has a snapshot to replan\n")
        return
    policy = rows[0]["policy"]
    width = max(12, len(policy) + 2)  # "topology_aware" is wider than the figures
    out.write(f"what-if: policy {policy} against the recorded plans (balancedness = mean over layers)\n")
    out.write(f"  {'round':<6}{'outcome':<10}{'recorded plan':<18}{'before':>8}{'recorded':>10}{'moved':>7}"
              f"{policy:>{width}}{'moved':>7}\n")
    for r in rows:
        out.write(f"  {r['round']:<6}{r['outcome']:<10}{r['recorded_plan'] or '-':<18}{r['balancedness_before']:>8.4f}"
                  f"{r['balancedness_recorded']:>10.4f}{r['moved_recorded']:>7}{r['balancedness_new']:>{width}.4f}"
                  f"{r['moved_new']:>7}\n")


def _key_order(key: str) -> tuple[int, str, int]:
    """cluster first, then rank:0.., then weights:0.. (numeric rank order)."""
    name, _, idx = key.partition(":")
    order = list(TABLE_OF_LABEL).index(name) if name in TABLE_OF_LABEL else len(TABLE_OF_LABEL)
    return order, name, int(idx) if idx.isdigit() else -1
