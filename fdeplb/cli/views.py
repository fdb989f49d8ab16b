"""``fdeplb audit``, ``fdeplb status`` and ``fdeplb replay``: read-only views of a cluster's machines.

- ``audit`` prints the audit stream (one line per record, or JSON lines), filtered by round, machine and rank,
  follows it (``--follow``: new records as they commit), or exports a self-contained recording
  (``--export FILE [--round N]``, :mod:`fdeplb.recording`) for ``replay``.
- ``status`` shows every machine's record now: the cluster rearrangement (state and FastDeploy code, round, plan,
  deadline left, reason, alarm, lease holder), each rank (rank state and load result, weight status, plan,
  whether the routing tables it holds have the current placement's digest, heartbeat age) and the current
  placement. A record that does not parse is shown as CORRUPT (a line naming key and field; ``--json``: the
  ``corrupt`` list) beside every other record, and the exit code is then 8; a corrupt configuration is only the
  error (exit 8).
- ``replay`` replays a recording with no Redis (:mod:`fdeplb.replay`): every transition, fence, guard and chain,
  every plan recomputed from its snapshot; ``--until`` stops at a record, ``--into`` rebuilds it in a Redis,
  ``--policy`` replans every round with another policy (what-if). Exit 0 when it replays, 1 on a mismatch (naming
  the first bad line), 2 on a usage error.

Bad input (unknown cluster, bad URL, bad filter, unreadable file) is a typed error: ``error: ...`` and a non-zero
exit code from the error table. Nothing here writes to Redis but ``replay --into`` (into a new cluster id).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterable, TextIO

from fdeplb.cli._common import open_store
from fdeplb.errors import CorruptRecordError, InputError, NotFoundError, exit_code
from fdeplb.machines.tables import CLUSTER, RANK, TABLES, WEIGHTS, ClusterState, RankState
from fdeplb.recording import audit_dict, export_recording

#: how long one ``audit --follow`` read blocks before it checks again (ms)
FOLLOW_BLOCK_MS = 1_000
#: default heartbeat age (ms) after which ``status`` marks a rank STALE
STALE_AFTER_MS = 10_000
#: how ``status`` shows a record that does not parse (in place of its state)
CORRUPT = "CORRUPT"


def register(sub: argparse._SubParsersAction) -> None:
    a = sub.add_parser("audit", help="print or export a cluster's audit records (one per transition)",
                       description="Print the audit stream of a cluster, oldest first, filtered; or export it "
                                   "as JSONL for `fdeplb replay`.")
    _cluster_args(a, http=True)
    a.add_argument("--round", type=int, default=None, help="only records of this round")
    a.add_argument("--machine", choices=tuple(TABLES), default=None, help="only records of this machine")
    a.add_argument("--rank", type=int, default=None, help="only records of this EP rank (rank and weights)")
    a.add_argument("--json", action="store_true", help="JSON lines instead of text")
    a.add_argument("--export", type=Path, default=None, metavar="FILE.jsonl",
                   help="write a self-contained recording (header, records, snapshots, plans; docs/recordings.md) "
                        "to FILE for `fdeplb replay`; with --round, the stretch of the audit holding that round")
    a.add_argument("--follow", action="store_true",
                   help="after the records so far, print new ones as they commit (until interrupted)")
    a.add_argument("--limit", type=int, default=None, metavar="N", help="stop after printing N records")
    a.set_defaults(handler=run_audit)

    s = sub.add_parser("status", help="show every machine's state of a cluster",
                       description="Show the cluster rearrangement record, every rank's rank and weight-status "
                                   "records, the lease holder and the current placement.")
    _cluster_args(s, http=True)
    s.add_argument("--json", action="store_true", help="one JSON object instead of text")
    s.add_argument("--stale-after", type=float, default=STALE_AFTER_MS / 1000, metavar="S",
                   help="mark a rank STALE when its last heartbeat is older than S seconds (default %(default)s; "
                        "an idle rank agent beats about once a second)")
    s.set_defaults(handler=run_status)

    r = sub.add_parser("replay", help="replay a recording through the machine tables, with no Redis",
                       description="Replay a recording (`fdeplb audit --export`) with no Redis: every record must "
                                   "follow from the ones before it (from-state, trigger, to-state, version, fence, "
                                   "the guards across records, the audit chain) and every plan, and every gated "
                                   "round's numbers, must reproduce from its snapshot. Exit 0 when it replays, 1 "
                                   "on a mismatch naming the first bad line, 2 on a usage error.")
    r.add_argument("file", type=Path, metavar="FILE.jsonl", help="recording written by `fdeplb audit --export`")
    r.add_argument("--until", default=None, metavar="VERSION|ID",
                   help="stop after the audit record with this id, or the cluster record's transition to this "
                        "version, and print every machine's state there")
    r.add_argument("--policy", default=None, metavar="NAME",
                   help="what-if: replan every recorded round's snapshot with this policy and compare it with the "
                        "recorded plan (balancedness, moved experts)")
    r.add_argument("--into", default=None, metavar="REDIS_URL",
                   help="rebuild the replayed records in this Redis under --cluster (refused if it exists)")
    r.add_argument("--redis-url", default=None, help="check the plans against this live Redis instead")
    r.add_argument("--cluster", default=None, help="cluster id (with --into or --redis-url)")
    r.add_argument("--json", action="store_true", help="print the report as one JSON object")
    r.set_defaults(handler=run_replay)


def _cluster_args(p: argparse.ArgumentParser, *, http: bool = False) -> None:
    """--redis-url and --cluster; with ``http``, or --url (and --credentials-file) of an `fdeplb serve` instead."""
    p.add_argument("--redis-url", required=not http, help="redis://host:port/db, rediss://... or unix:///path")
    p.add_argument("--cluster", required=not http, help="cluster id")
    if http:
        p.add_argument("--url", default=None, help="read through the HTTP API (http://host:port) instead of Redis")
        p.add_argument("--credentials-file", default=None, metavar="FILE", help="with --url: USER:PASSWORD file")


def _through_http(args: argparse.Namespace) -> bool:
    """True when the view reads through ``--url``; InputError when neither --url nor --redis-url + --cluster."""
    if args.url is not None:
        if args.redis_url is not None or args.cluster is not None:
            raise InputError("give --url, or --redis-url and --cluster, not both")
        return True
    if args.redis_url is None or args.cluster is None:
        raise InputError("give --redis-url and --cluster (or --url of an `fdeplb serve`)")
    return False


# ---- audit ---------------------------------------------------------------------------------------------------------
def select(entries: Iterable, *, round_: int | None = None, machine: str | None = None,
           rank: int | None = None) -> Iterable:
    """Audit entries matching every given filter (``rank`` selects the rank and weights records of that rank)."""
    keys = None if rank is None else {f"{RANK.name}:{rank}", f"{WEIGHTS.name}:{rank}"}
    for entry in entries:
        if round_ is not None and entry["round"] != str(round_):
            continue
        if machine is not None and entry["machine"] != machine:
            continue
        if keys is not None and entry["key"] not in keys:
            continue
        yield entry


def format_audit(entry) -> str:
    """One audit entry on one line: id, UTC time, round, key, trigger, from -> to, version, then plan, actor,
    reason when set."""
    f = entry.fields
    line = (f"{entry.id:<16} {_utc(f.get('ts_ms', ''))}  r{f.get('round', ''):<3} {f.get('key', ''):<10} "
            f"{f.get('trigger', ''):<8} {f.get('from', '')} -> {f.get('to', '')}  v{f.get('version', '')}")
    for name, label in (("plan_id", "plan"), ("actor", "actor"), ("reason", "reason")):
        if f.get(name):
            line += f"  {label}={json.dumps(f[name]) if ' ' in f[name] else f[name]}"
    return line


def _utc(ts_ms: str) -> str:
    try:
        ms = int(ts_ms)
    except ValueError:
        return "-" * 23
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"


def check_audit_args(args: argparse.Namespace) -> None:
    """The checks of ``fdeplb audit``'s options that need no cluster (both over Redis and over ``--url``):
    InputError naming the option."""
    if args.round is not None and args.round < 0:
        raise InputError(f"--round must be >= 0, got {args.round}")
    if args.limit is not None and args.limit < 1:
        raise InputError(f"--limit must be >= 1, got {args.limit}")
    if args.rank is not None and args.rank < 0:
        raise InputError(f"--rank must be >= 0, got {args.rank}")
    if args.rank is not None and args.machine == CLUSTER.name:
        raise InputError("--rank selects rank and weights records; it cannot be combined with --machine cluster")
    if args.export is not None and (args.machine or args.rank is not None or args.follow or args.json):
        raise InputError("--export writes a self-contained recording: only --round narrows it (--machine, --rank, "
                         "--follow, --json do not apply)")


def run_audit(args: argparse.Namespace) -> int:
    http = _through_http(args)
    check_audit_args(args)
    if http:
        from fdeplb.cli.http_client import run_audit as run_http_audit

        return run_http_audit(args)
    store = open_store(args.redis_url, args.cluster)
    if args.rank is not None and not 0 <= args.rank < store.ep_size():
        raise InputError(f"--rank {args.rank} outside the cluster's ranks 0..{store.ep_size() - 1}")
    if args.export is not None:
        n = export_recording(store, args.export, args.round)
        print(f"exported {n['records']} audit records, {n['snapshots']} snapshots and {n['plans']} plans of cluster "
              f"{args.cluster} to {args.export}" + (f" ({n['missing']} named but no longer in Redis)"
                                                    if n["missing"] else ""))
        return 0
    printed = 0
    last_id = "0-0"

    def emit(entries: Iterable) -> bool:
        nonlocal printed
        for entry in select(entries, round_=args.round, machine=args.machine, rank=args.rank):
            sys.stdout.write((json.dumps(audit_dict(entry)) if args.json else format_audit(entry)) + "\n")
            printed += 1
            if args.limit is not None and printed >= args.limit:
                return False
        sys.stdout.flush()
        return True

    def tracked(entries: Iterable) -> Iterable:
        nonlocal last_id
        for entry in entries:
            last_id = entry.id
            yield entry

    try:
        going = emit(tracked(store.iter_audit()))
        while going and args.follow:
            going = emit(tracked(store.follow_audit(last_id, FOLLOW_BLOCK_MS)))
        sys.stdout.flush()
    except KeyboardInterrupt:  # Ctrl-C ends --follow
        sys.stdout.flush()
    return 0


# ---- status --------------------------------------------------------------------------------------------------------
def commit_command(redis_url: str, cluster: str, plan_id: str) -> str:
    """The command that commits a cordoned cluster's staged plan ``plan_id``."""
    return f"fdeplb rearrange --redis-url {redis_url} --cluster {cluster} --commit {plan_id}"


def cluster_status(store, stale_after_ms: int = STALE_AFTER_MS, redis_url: str = "URL") -> dict[str, Any]:
    """Every machine record of the cluster now, as a JSON-ready dict (times from the Redis server's clock).
    A rank whose heartbeat is older than ``stale_after_ms`` is ``stale``; a cordoned round in LOAD_SUCC comes with
    its staged plan (``staged``: balancedness before/after, moved experts, the command that commits it).

    Routing: each rank's ``routing`` compares the digest of the routing tables it reported holding
    (``routing_digest``, written when it loads or swaps) with the current placement's
    (``placement.routing_digest``, :func:`fdeplb.placement.routing_digest` of its phy2log): ``match``,
    ``mismatch`` (listed in ``routing_mismatches``: the rank dispatches tokens differently from the others),
    ``swap_pending`` (the cluster is SWAPPING and the rank has not swapped yet: its old tables are expected),
    ``not_reported`` (no digest yet), or None (no rank record or no placement).

    Corrupt values: each record is read on its own, and one that does not parse (a value fdeplb did not write that
    way, :class:`~fdeplb.errors.CorruptRecordError`) is listed in ``corrupt`` (``[{"key", "error"}]``, the error
    naming the key and the field) and shown as ``CORRUPT`` while every other record is shown as usual: the
    cluster record as ``rearrange.state`` ``CORRUPT`` (its other fields None), a rank or weight-status record as
    that rank's ``state`` / ``weights`` ``CORRUPT``, the placement as ``placement.corrupt`` true (its fields None),
    a corrupt rank registry as every rank's ``registered`` None, a corrupt staged plan as ``staged`` None. A corrupt
    configuration raises :class:`~fdeplb.errors.CorruptRecordError` (without it nothing can be laid out); so do
    :class:`~fdeplb.errors.NotFoundError` (no cluster) and Redis errors."""
    from fdeplb.placement import routing_digest

    config = store.read_config()
    corrupt: list[dict[str, str]] = []

    def parsed(value):
        """``value`` unless it is a CorruptRecordError, which is listed in ``corrupt`` (then CORRUPT)."""
        if isinstance(value, CorruptRecordError):
            corrupt.append({"key": value.key or "", "error": str(value)})
            return CORRUPT
        return value

    def read(fn, *args):
        try:
            return fn(*args)
        except CorruptRecordError as err:
            return parsed(err)

    now = store.now_ms()
    rec = read(store.read_cluster)
    cluster_state = None if rec is CORRUPT else rec.state
    lease = store.lease_info()
    try:
        placement = read(store.current_placement)
    except NotFoundError:
        placement = None
    expected = routing_digest(placement.phy2log) if placement not in (None, CORRUPT) else None
    registered = read(store.rank_info)
    rank_records = [parsed(x) for x in store.read_each(RANK)]
    weight_records = [parsed(x) for x in store.read_each(WEIGHTS)]
    ranks = [_rank_status(r, rank, weights, None if registered is CORRUPT else r in registered, now, stale_after_ms,
                          expected, cluster_state)
             for r, (rank, weights) in enumerate(zip(rank_records, weight_records))]
    staged = None
    if config.cordoned and cluster_state is ClusterState.LOAD_SUCC and rec.plan_id:
        plan = read(store.read_plan, rec.plan_id)
        if plan not in (None, CORRUPT):
            staged = {"plan_id": plan.plan_id, "balancedness_before": plan.balancedness_before,
                      "balancedness_after": plan.balancedness_after, "moved_experts": plan.moved_experts,
                      "commit_command": commit_command(redis_url, store.cluster, plan.plan_id)}
    has_placement = placement not in (None, CORRUPT)
    return {
        "cluster": store.cluster,
        "now_ms": now,
        "stale_after_ms": stale_after_ms,
        "staged": staged,
        "config": {"ep_size": config.ep_size, "policy": config.policy, "cordoned": config.cordoned,
                   **config.topology()},
        "rearrange": {**_rearrange_status(rec, now), "lease_holder": lease.holder, "lease_ttl_ms": lease.ttl_ms},
        "placement": {"plan_id": placement.plan_id if has_placement else None,
                      "version": placement.version if has_placement else None, "routing_digest": expected,
                      "corrupt": placement is CORRUPT},
        "routing_mismatches": [r["ep_rank"] for r in ranks if r["routing"] == "mismatch"],
        "ranks": ranks,
        "corrupt": corrupt,
    }


def _rearrange_status(rec, now: int) -> dict[str, Any]:
    """The cluster record's part of :func:`cluster_status` (state CORRUPT and every other field None for one that
    does not parse)."""
    if rec is CORRUPT:
        return {"state": CORRUPT, **dict.fromkeys(("code", "version", "round", "requested", "requested_reason",
                                                    "plan_id", "deadline_left_ms", "reason", "alarm"))}
    return {
        "state": rec.state,
        "code": CLUSTER.to_code(rec.state),
        "version": rec.version,
        "round": rec.round,
        "requested": rec.requested,
        "requested_reason": rec.requested_reason,
        "plan_id": rec.plan_id,
        "deadline_left_ms": rec.deadline_ms - now if rec.deadline_ms else None,
        "reason": rec.reason,
        "alarm": rec.alarm,
    }


def _rank_status(r: int, rank, weights, registered: bool | None, now: int, stale_after_ms: int,
                 expected: str | None, cluster_state: ClusterState | None) -> dict[str, Any]:
    """One rank's row of :func:`cluster_status`: ``rank`` / ``weights`` are its records, None (missing) or CORRUPT
    (shown as that state, the fields that come from the record None)."""
    has_rank = rank not in (None, CORRUPT)
    has_weights = weights not in (None, CORRUPT)
    heartbeat = rank.heartbeat_ms if has_rank else 0
    return {
        "ep_rank": r,
        "registered": registered,
        "state": rank.state if has_rank else rank,
        "load_result": RANK.to_code(rank.state) if has_rank else None,
        "version": rank.version if has_rank else None,
        "plan_id": rank.plan_id if has_rank else None,
        "live_plan_id": rank.live_plan_id if has_rank else None,  # None: no agent has run yet
        "reason": rank.reason if has_rank else None,
        "heartbeat_age_ms": now - heartbeat if heartbeat else None,
        "stale": bool(heartbeat) and now - heartbeat > stale_after_ms,
        "weights": weights.state if has_weights else weights,
        "weights_code": WEIGHTS.to_code(weights.state) if has_weights else None,
        "weights_version": weights.version if has_weights else None,
        "routing_digest": (rank.routing_digest or None) if has_rank else None,
        "routing": _routing(rank, expected, cluster_state) if has_rank else None,
    }


def _routing(rank, expected: str | None, cluster_state: ClusterState | None) -> str | None:
    """How ``rank``'s reported routing digest compares with the placement's ``expected`` (see cluster_status)."""
    if rank is None or expected is None:
        return None
    if not rank.routing_digest:
        return "not_reported"
    if rank.routing_digest == expected:
        return "match"
    if cluster_state is ClusterState.SWAPPING and rank.state is not RankState.SWAPPED:
        return "swap_pending"
    return "mismatch"


def _ms(value: int | None, suffix: str = "") -> str:
    return "-" if value is None else f"{value / 1000:.1f} s{suffix}"


def print_status(status: dict[str, Any], out: TextIO) -> None:
    """The status dict as a short text report."""
    c, cfg, p = status["rearrange"], status["config"], status["placement"]
    pid = p["plan_id"]
    out.write(f"cluster {status['cluster']}  (ep_size {cfg['ep_size']}, {cfg['num_logical_experts']} experts in "
              f"{cfg['num_physical_experts']} slots x {cfg['num_layers']} layer{'' if cfg['num_layers'] == 1 else 's'}, policy {cfg['policy']}"
              f"{', cordoned' if cfg['cordoned'] else ''})\n")
    for bad in status.get("corrupt") or []:
        out.write(f"  CORRUPT    {bad['error']}\n")
    if c["state"] == CORRUPT:
        out.write("  rearrange  CORRUPT (the cluster record does not parse)\n")
    else:
        out.write(f"  rearrange  {c['state']} [{c['code']}]  v{c['version']}  round {c['round']} "
                  f"(requested {c['requested']})  plan {c['plan_id'] or '-'}\n")
    out.write(f"  deadline   {_ms(c['deadline_left_ms'], ' left')}\n")
    if c["reason"]:
        out.write(f"  reason     {c['reason']}\n")
    if c["alarm"]:
        out.write(f"  ALARM      {c['alarm']}\n")
    st = status.get("staged")
    if st:
        out.write(f"  staged     plan {st['plan_id']}: balancedness {st['balancedness_before']:.4f} -> "
                  f"{st['balancedness_after']:.4f}, {st['moved_experts']} moved experts; all ranks staged it\n")
        out.write(f"  commit     {st['commit_command']}\n")
    out.write(f"  lease      {c['lease_holder'] or '- (no coordinator leads)'}"
              f"{'  (ttl ' + _ms(c['lease_ttl_ms']) + ')' if c['lease_holder'] else ''}\n")
    out.write(f"  placement  {CORRUPT if p.get('corrupt') else '-' if pid is None else (pid or 'initial')}"
              f"{'' if p['version'] is None else '  v' + str(p['version'])}"
              f"{'  routing digest ' + p['routing_digest'] if p.get('routing_digest') else ''}\n")
    mismatches = status.get("routing_mismatches") or []
    if mismatches:
        out.write(f"  ROUTING MISMATCH  rank{'s' if len(mismatches) > 1 else ''} "
                  f"{', '.join(map(str, mismatches))} hold{'' if len(mismatches) > 1 else 's'} routing tables that "
                  f"differ from the placement's: tokens are dispatched inconsistently\n")
    out.write(f"  {'rank':<6}{'state':<12}{'load_result':<12}{'weights':<10}{'code':<6}{'plan':<18}{'live':<18}"
              f"{'routing':<14}heartbeat\n")
    for r in status["ranks"]:
        live = "-" if r["live_plan_id"] is None else (r["live_plan_id"] or "initial")
        routing = _ROUTING_TEXT.get(r.get("routing"), "-")
        bad = (f"  ROUTING MISMATCH (digest {r['routing_digest']} != {p['routing_digest']})"
               if r.get("routing") == "mismatch" else "")
        line = (f"  {r['ep_rank']:<6}{r['state'] or '-':<12}{_opt(r['load_result']):<12}{r['weights'] or '-':<10}"
                f"{_opt(r['weights_code']):<6}{r['plan_id'] or '-':<18}{live:<18}{routing:<14}"
                f"{_ms(r['heartbeat_age_ms'], ' ago'):<12}"
                f"{'not registered' if r['registered'] is False else ''}"
                f"{'  STALE (> ' + _ms(status['stale_after_ms']) + ')' if r.get('stale') else ''}"
                f"{bad}")
        out.write(line.rstrip() + "\n")


#: the routing column of ``status``'s text (see :func:`cluster_status` for the values)
_ROUTING_TEXT = {"match": "ok", "mismatch": "MISMATCH", "swap_pending": "swap pending", "not_reported": "unreported"}


def _opt(value: Any) -> str:
    return "-" if value is None else str(value)


def run_status(args: argparse.Namespace) -> int:
    if _through_http(args):
        from fdeplb.cli.http_client import run_status as run_http_status

        return run_http_status(args)
    if not args.stale_after > 0:
        raise InputError(f"--stale-after must be > 0 seconds, got {args.stale_after}")
    store = open_store(args.redis_url, args.cluster)
    return show_status(cluster_status(store, int(args.stale_after * 1000), args.redis_url), args.json)


def show_status(status: dict[str, Any], as_json: bool) -> int:
    """Print ``status`` (:func:`cluster_status`'s dict, from Redis or ``GET /v1/state``) as JSON or text; the exit
    code: 0, or that of :class:`~fdeplb.errors.CorruptRecordError` (8) when a record did not parse (everything
    readable is printed all the same, and stderr names the corrupt keys)."""
    if as_json:
        print(json.dumps(status, sort_keys=True))
    else:
        print_status(status, sys.stdout)
    corrupt = status.get("corrupt") or []
    if not corrupt:
        return 0
    sys.stdout.flush()
    print(f"error: {len(corrupt)} stored value{'s' if len(corrupt) > 1 else ''} of cluster {status['cluster']} did "
          f"not parse: {', '.join(c['key'] or '?' for c in corrupt)}", file=sys.stderr)
    return exit_code(CorruptRecordError(""))


# ---- replay --------------------------------------------------------------------------------------------------------
def run_replay(args: argparse.Namespace) -> int:
    from fdeplb.replay import Recorded, ReplayError, check_gates, check_plans, rebuild, replay_file, whatif
    from fdeplb.store import Store

    if args.into is not None and args.redis_url is not None:
        raise InputError("--into (rebuild into a Redis) and --redis-url (check against a live one) exclude each "
                         "other")
    if (args.into is not None or args.redis_url is not None) != (args.cluster is not None):
        raise InputError("--cluster goes with --into or --redis-url (the cluster to rebuild or check against)")
    into = Store(args.into, args.cluster) if args.into is not None else None  # a bad URL or id: before replaying
    report = replay_file(args.file, args.until)
    if report.records == 0:
        raise ReplayError(f"{args.file}: no audit records (a recording has one JSON object per line)")
    if args.redis_url is not None:
        check_plans(open_store(args.redis_url, args.cluster), report)
    elif report.header is not None:
        check_plans(Recorded(report), report)
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
    chain = f", chain verified over {report.chained} records" if report.chained else ", no chain (old export)"
    print(f"replay OK: {report.transitions} transitions of {len(report.final)} records, "
          f"{report.skipped} notes (alarms, skips, start refusals){chain}{plans}")
    if rows is not None:
        print_whatif(rows, sys.stdout)
    if written is not None:
        print(f"rebuilt cluster {args.cluster} at {args.into}: {written} audit records")
    return 0


def _states(report) -> dict[str, dict[str, Any]]:
    """Every machine's state where the replay stopped: the replayed ones, and the header's start for the others."""
    out: dict[str, dict[str, Any]] = {}
    for key, held in ((report.header or {}).get("start") or {}).get("records", {}).items():
        table = TABLES[key.partition(":")[0]]
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
    out.write(f"what-if: policy {policy} against the recorded plans (balancedness = mean over layers)\n")
    out.write(f"  {'round':<6}{'outcome':<10}{'recorded plan':<18}{'before':>8}{'recorded':>10}{'moved':>7}"
              f"{policy:>12}{'moved':>7}\n")
    for r in rows:
        out.write(f"  {r['round']:<6}{r['outcome']:<10}{r['recorded_plan'] or '-':<18}{r['balancedness_before']:>8.4f}"
                  f"{r['balancedness_recorded']:>10.4f}{r['moved_recorded']:>7}{r['balancedness_new']:>12.4f}"
                  f"{r['moved_new']:>7}\n")


def _key_order(key: str) -> tuple[int, str, int]:
    """cluster first, then rank:0.., then weights:0.. (numeric rank order)."""
    name, _, idx = key.partition(":")
    order = list(TABLES).index(name) if name in TABLES else len(TABLES)
    return order, name, int(idx) if idx.isdigit() else -1
