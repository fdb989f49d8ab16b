"""``fdeplb status``: every machine's record of a cluster now, as text or one JSON object.

It shows the cluster rearrangement (state and FastDeploy code, round, plan, deadline left, reason, alarm, lease
holder), each rank (rank state and load result, weight status, plan, whether the routing tables it holds have the
current placement's digest, heartbeat age, STALE once the heartbeat outlived the TTL its agent wrote) and the
current placement. The data is :func:`fdeplb.status.cluster_status`'s, read from Redis (``--redis-url`` /
``--cluster``) or through an ``fdeplb serve`` (``--url``: ``GET /v1/state``, the same dict). A record that does not
parse is shown as CORRUPT (a line naming key and field; ``--json``: the ``corrupt`` list) beside every other record,
and the exit code is then 8; a corrupt configuration is only the error (exit 8).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from fdeplb.cli._common import open_store, redis_or_url_parent, through_http
from fdeplb.errors import CorruptRecordError, InputError, exit_code
from fdeplb.placement import FORMATS
from fdeplb.placement.files import check_placement_path, save_placement_text
from fdeplb.status import CORRUPT, cluster_status, placement_file


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("status", help="show every machine's state of a cluster",
                       description="Show the cluster rearrangement record, every rank's rank and weight-status "
                                   "records, the lease holder and the current placement. A rank is STALE once its "
                                   "heartbeat is older than the TTL its agent wrote with it (the rule the "
                                   "coordinator uses to refuse a start).", parents=[redis_or_url_parent()])
    s.add_argument("--json", action="store_true", help="one JSON object instead of text")
    s.add_argument("--placement-out", default=None, metavar="FILE",
                   help="also write the current placement to FILE, in --format, with the model's layers (SGLang: "
                        "one row per model layer, dense ones included; TensorRT-LLM: model layer keys, named *.yaml; "
                        "gzip when named .gz)")
    s.add_argument("--format", default="sglang", choices=FORMATS, help="format of --placement-out (default %(default)s)")
    s.set_defaults(handler=run_status)


def run_status(args: argparse.Namespace) -> int:
    """``fdeplb status``: :func:`fdeplb.status.cluster_status` from Redis, or ``GET /v1/state`` with ``--url``."""
    from fdeplb.cli._common import check_out_folder

    check_out_folder("--placement-out", args.placement_out)
    if args.placement_out:  # a trtllm placement is YAML (*.yaml), the others JSON: the rule rebalance --out follows
        check_placement_path(args.placement_out, args.format, "--placement-out")
    if through_http(args):
        from fdeplb.cli.http_client import ApiClient

        if args.placement_out:
            raise InputError(f"--placement-out reads from Redis; through the API the same file is GET "
                             f"{args.url}/v1/placement?format={args.format}")
        status = ApiClient(args.url, args.credentials_file, ca_cert=args.ca_cert).get("/v1/state")
        status.pop("api_addresses", None)
    else:
        store = open_store(args.redis_url, args.cluster)
        status = cluster_status(store, args.redis_url)
        if args.placement_out:
            save_placement_text(args.placement_out, placement_file(store, args.format), args.format, "--placement-out")
            print(f"wrote {args.format} placement to {args.placement_out}", file=sys.stderr)
    return show_status(status, args.json)


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


def _ms(value: int | None, suffix: str = "") -> str:
    return "-" if value is None else f"{value / 1000:.1f} s{suffix}"


def print_status(status: dict[str, Any], out: TextIO) -> None:
    """The status dict as a short text report."""
    c, cfg, p = status["rearrange"], status["config"], status["placement"]
    pid = p["plan_id"]
    layers = f"{cfg['num_layers']} layer{'' if cfg['num_layers'] == 1 else 's'}"
    out.write(f"cluster {status['cluster']}  (ep_size {cfg['ep_size']}, {cfg['num_logical_experts']} experts in "
              f"{cfg['num_physical_experts']} slots x {layers}, "
              f"policy {cfg['policy']}"
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
    if c.get("probe_mismatch"):
        out.write(f"  PROBE      {c['probe_mismatch']}\n")
    st = status.get("staged")
    if st:
        out.write(f"  staged     plan {st['plan_id']}: balancedness {st['balancedness_before']:.4f} -> "
                  f"{st['balancedness_after']:.4f}, {st['moved_experts']} moved experts; all ranks staged it\n")
        out.write(f"  commit     {st['commit_command']}\n")
    if status.get("generation") is not None:
        out.write(f"  members    {', '.join(map(str, status.get('live_ranks') or [])) or 'none'} ACTIVE  "
                  f"(generation {status['generation']})\n")
    deg = status.get("degraded")
    if deg:
        shown = ", ".join(f"layer {l} expert {e}" for l, e in deg["orphans"][:10])
        out.write(f"  DEGRADED   {len(deg['orphans'])} experts have no replica on a member ({shown}"
                  f"{' ...' if len(deg['orphans']) > 10 else ''}); ranks {deg['ranks']} are not members\n")
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
    out.write(f"  {'rank':<6}{'state':<12}{'load_result':<12}{'weights':<10}{'code':<6}{'member':<11}{'plan':<18}"
              f"{'live':<18}{'routing':<14}heartbeat\n")
    for r in status["ranks"]:
        out.write(_rank_line(r, p).rstrip() + "\n")


def _rank_line(r: dict[str, Any], p: dict[str, Any]) -> str:
    """One rank's row of :func:`print_status` (``p``: the status' placement part)."""
    live = "-" if r["live_plan_id"] is None else (r["live_plan_id"] or "initial")
    routing = _ROUTING_TEXT.get(r.get("routing"), "-")
    bad = (f"  ROUTING MISMATCH (digest {r['routing_digest']} != {p['routing_digest']})"
           if r.get("routing") == "mismatch" else "")
    stale = f"  STALE (> {_ms(r.get('heartbeat_ttl_ms'))})" if r.get("stale") else ""  # older than its TTL
    bad += f"  PROBE {r['probe'].upper()}" if r.get("probe") in ("mismatch", "failed") else ""  # its last swap's
    peers = (f"  staged {r['peer_bytes']} B from peers, {r['disk_bytes']} B from disk"  # its last staging's sources
             if r.get("peer_bytes") or r.get("disk_bytes") else "")  # (0 from peers: a wrong secret, none live)
    return (f"  {r['ep_rank']:<6}{r['state'] or '-':<12}{_opt(r['load_result']):<12}{r['weights'] or '-':<10}"
            f"{_opt(r['weights_code']):<6}{r.get('membership') or '-':<11}{r['plan_id'] or '-':<18}{live:<18}"
            f"{routing:<14}"
            f"{_ms(r['heartbeat_age_ms'], ' ago'):<12}"
            f"{'not registered' if r['registered'] is False else ''}{stale}{bad}{peers}")


#: the routing column of ``status``'s text (see :func:`cluster_status` for the values)
_ROUTING_TEXT = {"match": "ok", "mismatch": "MISMATCH", "swap_pending": "swap pending", "not_reported": "unreported",
                 "not_member": "not member"}


def _opt(value: Any) -> str:
    return "-" if value is None else str(value)
