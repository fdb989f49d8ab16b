"""``fdeplb audit``: print a cluster's audit stream, follow it, or export it as a recording.

It prints one line per record (or JSON lines), filtered by round, machine and rank, oldest first; ``--follow`` then
prints new records as they commit, riding out a restart of Redis or of the server for up to ``--retry-timeout`` s
(:func:`fdeplb.backoff.ride_out`, said once on stderr); ``--export FILE [--round N]`` writes a self-contained
recording (:mod:`fdeplb.recording`) for ``fdeplb replay``. The records come from Redis (``--redis-url`` /
``--cluster``) or through an ``fdeplb serve`` (``--url``, :meth:`fdeplb.cli.http_client.ApiClient.audit_pages`);
both give pages of :class:`~fdeplb.store.AuditRecord` that one loop filters and prints, so the output is the same.

Bad input (unknown cluster, bad URL, bad filter, unwritable file) is a typed error: ``error: ...`` and a non-zero
exit code from the error table. Nothing here writes to Redis.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator

from fdeplb.backoff import ride_out
from fdeplb.cli._common import open_store, redis_or_url_parent, through_http
from fdeplb.errors import InputError
from fdeplb.options import positive_float
from fdeplb.machines.tables import CLUSTER, MEMBERSHIP, RANK, TABLES, WEIGHTS
from fdeplb.input_files import check_output
from fdeplb.recording import audit_dict, export_recording

#: how long one ``audit --follow`` read of Redis blocks before it checks again (ms)
FOLLOW_BLOCK_MS = 1_000
#: default of ``--retry-timeout``: seconds one outage of Redis (or of the --url server) is waited out by --follow
RETRY_TIMEOUT_S = 300.0


def register(sub: argparse._SubParsersAction) -> None:
    a = sub.add_parser("audit", help="print or export a cluster's audit records (one per transition)",
                       description="Print the audit stream of a cluster, oldest first, filtered; or export it "
                                   "as JSONL for `fdeplb replay`.", parents=[redis_or_url_parent()])
    a.add_argument("--round", type=int, default=None, help="only records of this round")
    a.add_argument("--machine", choices=tuple(TABLES), default=None, help="only records of this machine")
    a.add_argument("--rank", type=int, default=None, help="only records of this EP rank (rank and weights)")
    a.add_argument("--json", action="store_true", help="JSON lines instead of text")
    a.add_argument("--export", type=Path, default=None, metavar="FILE.jsonl",
                   help="write a self-contained recording (header, records, snapshots, plans; docs/recordings.md) "
                        "to FILE for `fdeplb replay`; with --round, the stretch of the audit holding that round")
    a.add_argument("--follow", action="store_true",
                   help="after the records so far, print new ones as they commit (until interrupted); an outage of "
                        "Redis or of the --url server (a restart) is waited out with back-off, said once on stderr")
    a.add_argument("--retry-timeout", type=positive_float, default=None, metavar="S",
                   help=f"with --follow: how long one outage is waited out before exiting 7 (default "
                        f"{RETRY_TIMEOUT_S:g} s)")
    a.add_argument("--limit", type=int, default=None, metavar="N", help="stop after printing N records")
    a.set_defaults(handler=run_audit)


def select(entries: Iterable, *, round_: int | None = None, machine: str | None = None,
           rank: int | None = None) -> Iterable:
    """Audit entries matching every given filter (``rank`` selects the rank and weights records of that rank)."""
    keys = None if rank is None else {f"{RANK.name}:{rank}", f"{WEIGHTS.name}:{rank}", f"{MEMBERSHIP.key_label}:{rank}"}
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
    if args.retry_timeout is not None and not args.follow:
        raise InputError("--retry-timeout bounds how long --follow waits out an outage: it needs --follow")
    if args.export is not None and (args.machine or args.rank is not None or args.follow or args.json):
        raise InputError("--export writes a self-contained recording: only --round narrows it (--machine, --rank, "
                         "--follow, --json do not apply)")


def run_audit(args: argparse.Namespace) -> int:
    """``fdeplb audit``: from Redis or, with ``--url``, through the HTTP API (no ``--export`` there: a recording
    needs the snapshots and plans too)."""
    http = through_http(args)
    check_audit_args(args)
    if http:
        from fdeplb.cli.http_client import AUDIT_PAGE, ApiClient

        if args.export is not None:
            raise InputError("--export writes a self-contained recording (snapshots and plans too): use --redis-url")
        client = ApiClient(args.url, args.credentials_file, ca_cert=args.ca_cert)
        filtered = args.round is not None or args.machine is not None or args.rank is not None
        # unfiltered, the server stops at --limit itself; filtered, the records to print are only known here
        page_size = min(args.limit, AUDIT_PAGE) if args.limit is not None and not filtered else AUDIT_PAGE
        return print_audit(client.audit_pages(page_size, args.follow, args.retry_timeout or RETRY_TIMEOUT_S), args)
    if args.export is not None:  # before any work: a FIFO or device is refused, never waited on
        check_output(args.export, "the recording", label=f"--export {args.export}")
    store = open_store(args.redis_url, args.cluster)
    if args.rank is not None and not 0 <= args.rank < store.ep_size():
        raise InputError(f"--rank {args.rank} outside the cluster's ranks 0..{store.ep_size() - 1}")
    if args.export is not None:
        n = export_recording(store, args.export, args.round)
        print(f"exported {n['records']} audit records, {n['snapshots']} snapshots and {n['plans']} plans of cluster "
              f"{args.cluster} to {args.export}" + (f" ({n['missing']} named but no longer in Redis)"
                                                    if n["missing"] else ""))
        return 0
    return print_audit(store_pages(store, args.follow, args.retry_timeout or RETRY_TIMEOUT_S), args)


def store_pages(store, follow: bool = False, retry_s: float = 0.0) -> Iterator[Iterable]:
    """The audit stream read from Redis as pages (lazy iterables of :class:`~fdeplb.store.AuditRecord`): every
    record so far, then, with ``follow``, what each blocking read (:data:`FOLLOW_BLOCK_MS`) brings; a read that
    finds Redis away is retried for up to ``retry_s`` s (:func:`fdeplb.backoff.ride_out`), then
    :class:`~fdeplb.errors.RedisUnavailableError`. Consume each page before asking for the next: the next read
    starts after the last record consumed."""
    last_id = "0-0"

    def tracked(entries: Iterable) -> Iterator:
        nonlocal last_id
        for entry in entries:
            last_id = entry.id
            yield entry

    yield tracked(store.iter_audit())
    while follow:
        yield tracked(ride_out(lambda: store.follow_audit(last_id, FOLLOW_BLOCK_MS), what=f"Redis at {store.url}",
                               retry_s=retry_s))


def print_audit(pages: Iterable[Iterable], args: argparse.Namespace) -> int:
    """Print the records of ``pages`` that ``args``' filters select (text or ``--json`` lines), flushing after each
    page, until the pages end, ``--limit`` records are printed, or Ctrl-C (which ends ``--follow``). Returns 0."""
    printed = 0
    try:
        for page in pages:
            for entry in select(page, round_=args.round, machine=args.machine, rank=args.rank):
                sys.stdout.write((json.dumps(audit_dict(entry)) if args.json else format_audit(entry)) + "\n")
                printed += 1
                if args.limit is not None and printed >= args.limit:
                    sys.stdout.flush()
                    return 0
            sys.stdout.flush()
    except KeyboardInterrupt:  # Ctrl-C ends --follow
        sys.stdout.flush()
    return 0
