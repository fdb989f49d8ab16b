"""``fdeplb audit``, ``fdeplb status`` and ``fdeplb replay``: read-only views of a cluster's machines.

- ``audit`` prints the audit stream (one line per record, or JSON lines), filtered by round, machine and rank, or
  exports it as JSONL (``--export FILE``) for ``replay``.
- ``status`` shows every machine's record now: the cluster rearrangement (state and FastDeploy code, round, plan,
  deadline left, reason, alarm, lease holder), each rank (rank state and load result, weight status, plan,
  heartbeat age) and the current placement.
- ``replay`` replays an exported audit through the tables (:mod:`fdeplb.replay`) and, given a Redis URL, recomputes
  every plan from its stored snapshot.

Bad input (unknown cluster, bad URL, bad filter, unreadable file) is a typed error: ``error: ...`` and a non-zero
exit code from the error table. Nothing here writes to Redis.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable, TextIO

from fdeplb.cli._common import open_store
from fdeplb.errors import InputError, NotFoundError
from fdeplb.machines.tables import CLUSTER, RANK, TABLES, WEIGHTS

#: audit fields written as integers in JSON output (the stream stores text)
INT_FIELDS = ("version", "round", "ts_ms")


def register(sub: argparse._SubParsersAction) -> None:
    a = sub.add_parser("audit", help="print or export a cluster's audit records (one per transition)",
                       description="Print the audit stream of a cluster, oldest first, filtered; or export it "
                                   "as JSONL for `fdeplb replay`.")
    _cluster_args(a)
    a.add_argument("--round", type=int, default=None, help="only records of this round")
    a.add_argument("--machine", choices=tuple(TABLES), default=None, help="only records of this machine")
    a.add_argument("--rank", type=int, default=None, help="only records of this EP rank (rank and weights)")
    a.add_argument("--json", action="store_true", help="JSON lines instead of text")
    a.add_argument("--export", type=Path, default=None, metavar="FILE.jsonl",
                   help="write the (filtered) records to FILE as JSONL instead of printing them")
    a.set_defaults(handler=run_audit)

    s = sub.add_parser("status", help="show every machine's state of a cluster",
                       description="Show the cluster rearrangement record, every rank's rank and weight-status "
                                   "records, the lease holder and the current placement.")
    _cluster_args(s)
    s.add_argument("--json", action="store_true", help="one JSON object instead of text")
    s.set_defaults(handler=run_status)

    r = sub.add_parser("replay", help="replay an exported audit through the machine tables",
                       description="Replay an exported audit through the machine tables: every record must "
                                   "follow from the ones before it (from-state, trigger, to-state, version). "
                                   "With --redis-url and --cluster, also recompute every plan from its stored "
                                   "snapshot.")
    r.add_argument("file", type=Path, metavar="FILE.jsonl", help="audit exported by `fdeplb audit --export`")
    r.add_argument("--redis-url", default=None, help="also recompute every plan from the snapshots stored here")
    r.add_argument("--cluster", default=None, help="cluster the export came from (with --redis-url)")
    r.add_argument("--json", action="store_true", help="print the report as one JSON object")
    r.set_defaults(handler=run_replay)


def _cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", required=True, help="redis://host:port/db, rediss://... or unix:///path")
    p.add_argument("--cluster", required=True, help="cluster id")


# ---- audit ---------------------------------------------------------------------------------------------------------
def audit_dict(entry) -> dict[str, Any]:
    """An audit entry as a JSON-ready dict: ``id`` first, then its fields; version, round and ts_ms as ints."""
    out: dict[str, Any] = {"id": entry.id}
    for name, value in entry.fields.items():
        out[name] = int(value) if name in INT_FIELDS and value.lstrip("-").isdigit() else value
    return out


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


def run_audit(args: argparse.Namespace) -> int:
    if args.round is not None and args.round < 0:
        raise InputError(f"--round must be >= 0, got {args.round}")
    if args.rank is not None and args.machine == CLUSTER.name:
        raise InputError("--rank selects rank and weights records; it cannot be combined with --machine cluster")
    store = open_store(args.redis_url, args.cluster)
    if args.rank is not None and not 0 <= args.rank < store.ep_size():
        raise InputError(f"--rank {args.rank} outside the cluster's ranks 0..{store.ep_size() - 1}")
    entries = select(store.iter_audit(), round_=args.round, machine=args.machine, rank=args.rank)
    if args.export is not None:
        n = export_audit(entries, args.export)
        print(f"exported {n} audit records of cluster {args.cluster} to {args.export}")
        return 0
    try:
        for entry in entries:
            sys.stdout.write((json.dumps(audit_dict(entry)) if args.json else format_audit(entry)) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # `fdeplb audit ... | head`: the reader has what it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def export_audit(entries: Iterable, path: Path) -> int:
    """Write audit entries as JSONL to ``path`` (atomically: a temporary file renamed into place); returns how many.
    :class:`InputError` if the file cannot be written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    n = 0
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            for entry in entries:
                fh.write(json.dumps(audit_dict(entry)) + "\n")
                n += 1
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise InputError(f"cannot write {path}: {exc.strerror}") from None
    return n


# ---- status --------------------------------------------------------------------------------------------------------
def cluster_status(store) -> dict[str, Any]:
    """Every machine record of the cluster now, as a JSON-ready dict (times from the Redis server's clock)."""
    config = store.read_config()
    now = store.now_ms()
    rec = store.read_cluster()
    deadline = rec.deadline_ms
    lease = store.lease_info()
    try:
        placement = store.current_placement()
        placement_plan, placement_version = placement.plan_id, placement.version
    except NotFoundError:
        placement_plan, placement_version = None, None
    registered = store.rank_info()
    ranks = []
    for r in range(config.ep_size):
        rank = _maybe_record(store, RANK, r)
        weights = _maybe_record(store, WEIGHTS, r)
        heartbeat = rank.heartbeat_ms if rank else 0
        ranks.append({
            "ep_rank": r,
            "registered": r in registered,
            "state": rank.state if rank else None,
            "load_result": RANK.to_code(rank.state) if rank else None,
            "version": rank.version if rank else None,
            "plan_id": rank.plan_id if rank else None,
            "live_plan_id": rank.live_plan_id if rank else None,  # None: no agent has run yet
            "reason": rank.reason if rank else None,
            "heartbeat_age_ms": now - heartbeat if heartbeat else None,
            "weights": weights.state if weights else None,
            "weights_code": WEIGHTS.to_code(weights.state) if weights else None,
            "weights_version": weights.version if weights else None,
        })
    return {
        "cluster": store.cluster,
        "now_ms": now,
        "config": {"ep_size": config.ep_size, "policy": config.policy, "cordoned": config.cordoned,
                   **config.topology()},
        "rearrange": {
            "state": rec.state,
            "code": CLUSTER.to_code(rec.state),
            "version": rec.version,
            "round": rec.round,
            "requested": rec.requested,
            "plan_id": rec.plan_id,
            "deadline_left_ms": deadline - now if deadline else None,
            "reason": rec.reason,
            "alarm": rec.alarm,
            "lease_holder": lease.holder,
            "lease_ttl_ms": lease.ttl_ms,
        },
        "placement": {"plan_id": placement_plan, "version": placement_version},
        "ranks": ranks,
    }


def _maybe_record(store, table, ep_rank: int):
    try:
        return store.read(table, ep_rank)
    except NotFoundError:
        return None


def _ms(value: int | None, suffix: str = "") -> str:
    return "-" if value is None else f"{value / 1000:.1f} s{suffix}"


def print_status(status: dict[str, Any], out: TextIO) -> None:
    """The status dict as a short text report."""
    c, cfg, p = status["rearrange"], status["config"], status["placement"]
    pid = p["plan_id"]
    out.write(f"cluster {status['cluster']}  (ep_size {cfg['ep_size']}, {cfg['num_logical_experts']} experts in "
              f"{cfg['num_physical_experts']} slots x {cfg['num_layers']} layers, policy {cfg['policy']}"
              f"{', cordoned' if cfg['cordoned'] else ''})\n")
    out.write(f"  rearrange  {c['state']} [{c['code']}]  v{c['version']}  round {c['round']} "
              f"(requested {c['requested']})  plan {c['plan_id'] or '-'}\n")
    out.write(f"  deadline   {_ms(c['deadline_left_ms'], ' left')}\n")
    if c["reason"]:
        out.write(f"  reason     {c['reason']}\n")
    if c["alarm"]:
        out.write(f"  ALARM      {c['alarm']}\n")
    out.write(f"  lease      {c['lease_holder'] or '- (no coordinator leads)'}"
              f"{'  (ttl ' + _ms(c['lease_ttl_ms']) + ')' if c['lease_holder'] else ''}\n")
    out.write(f"  placement  {'-' if pid is None else (pid or 'initial')}"
              f"{'' if p['version'] is None else '  v' + str(p['version'])}\n")
    out.write(f"  {'rank':<6}{'state':<12}{'load_result':<12}{'weights':<10}{'code':<6}{'plan':<18}{'live':<18}"
              f"heartbeat\n")
    for r in status["ranks"]:
        live = "-" if r["live_plan_id"] is None else (r["live_plan_id"] or "initial")
        line = (f"  {r['ep_rank']:<6}{r['state'] or '-':<12}{_opt(r['load_result']):<12}{r['weights'] or '-':<10}"
                f"{_opt(r['weights_code']):<6}{r['plan_id'] or '-':<18}{live:<18}"
                f"{_ms(r['heartbeat_age_ms'], ' ago'):<12}"
                f"{'' if r['registered'] else 'not registered'}")
        out.write(line.rstrip() + "\n")


def _opt(value: Any) -> str:
    return "-" if value is None else str(value)


def run_status(args: argparse.Namespace) -> int:
    store = open_store(args.redis_url, args.cluster)
    status = cluster_status(store)
    if args.json:
        print(json.dumps(status, sort_keys=True))
    else:
        print_status(status, sys.stdout)
    return 0


# ---- replay --------------------------------------------------------------------------------------------------------
def run_replay(args: argparse.Namespace) -> int:
    from fdeplb.replay import ReplayError, check_plans, replay_file

    if (args.redis_url is None) != (args.cluster is None):
        raise InputError("--redis-url and --cluster go together (the cluster whose plans to recompute)")
    report = replay_file(args.file)
    if report.records == 0:
        raise ReplayError(f"{args.file}: no audit records (an export has one JSON object per line)")
    if args.redis_url is not None:
        check_plans(open_store(args.redis_url, args.cluster), report)
    if args.json:
        print(json.dumps(report.to_json(), sort_keys=True))
        return 0
    for key, ks in sorted(report.final.items(), key=lambda kv: _key_order(kv[0])):
        print(f"{key:<12} {ks.state} [{ks.code}]  v{ks.version}  ({ks.transitions} transitions, last "
              f"{ks.last_trigger})")
    plans = (f", {len(report.plans_checked)} plans recomputed and identical" if args.redis_url is not None
             else f", {len(report.plans)} plans (pass --redis-url and --cluster to recompute them)")
    print(f"replay OK: {report.transitions} transitions of {len(report.final)} records, "
          f"{report.skipped} alarms skipped{plans}")
    return 0


def _key_order(key: str) -> tuple[int, str, int]:
    """cluster first, then rank:0.., then weights:0.. (numeric rank order)."""
    name, _, idx = key.partition(":")
    order = list(TABLES).index(name) if name in TABLES else len(TABLES)
    return order, name, int(idx) if idx.isdigit() else -1
