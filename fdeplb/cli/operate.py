"""Operating a cluster: ``fdeplb init-cluster`` (create its records), ``fdeplb coordinator`` (the sidecar that
drives it) and ``fdeplb rearrange`` (ask for a round, one to an operator's plan file, or commit a cordoned one)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import sys

import numpy as np

from fdeplb.cli.cluster_cmd import deadline_flags
from fdeplb.options import audit_dir_parent, cluster_parent, positive_float
from fdeplb.placement import POLICIES
from fdeplb.store import ClusterConfig, Deadlines

#: the audit notes of a round request withdrawn before it started (the coordinator's expiry, an operator's cancel)
WITHDRAWN = ("request_expired", "request_cancelled")
_CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ClusterConfig)}
_DEADLINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Deadlines)}


#: init-cluster's default --adopt-wait-ms: an agent's default heartbeat TTL (10 s) + a quarter of it (the agents
#: report within a quarter TTL of noticing their records are gone)
ADOPT_WAIT_MS = 12_500


def register(sub: argparse._SubParsersAction) -> None:
    i = sub.add_parser("init-cluster", help="create a cluster's configuration, placement and machine records",
                       description="Create a cluster in Redis: its topology and settings, the initial placement "
                                   "(trivial, or --initial FILE) and one record per machine at version 0. "
                                   "An existing cluster with the same configuration is left as it is; one with "
                                   "other settings is refused (change them with `fdeplb config set`).",
                       parents=[cluster_parent(), audit_dir_parent()])
    i.add_argument("--num-layers", type=int, required=True, help="MoE layers")
    i.add_argument("--num-logical-experts", type=int, required=True)
    i.add_argument("--num-redundant-experts", type=int, required=True)
    i.add_argument("--ep-size", type=int, required=True, help="EP ranks (GPUs)")
    i.add_argument("--num-nodes", type=int, default=_CONFIG_DEFAULTS["num_nodes"])
    i.add_argument("--num-groups", type=int, default=_CONFIG_DEFAULTS["num_groups"])
    i.add_argument("--policy", default=_CONFIG_DEFAULTS["policy"], choices=tuple(POLICIES),
                   help="placement policy (default %(default)s)")
    i.add_argument("--checkpoint", required=True,
                   help="safetensors checkpoint directory or file; stored as its absolute path (resolved from the "
                        "current directory), which every rank must be able to read")
    i.add_argument("--preset", default="ernie", help="expert tensor names (ernie, ernie-quant, generic)")
    i.add_argument("--initial", default=None, help="initial placement file (fdeplb, sglang, trtllm, fastdeploy)")
    i.add_argument("--cordoned", action="store_true", help="commit only on an external request")
    i.add_argument("--min-gain", type=float, default=_CONFIG_DEFAULTS["min_gain"],
                   help="least balancedness gain worth a round, in [0, 1]")
    i.add_argument("--retain-rounds", type=int, default=_CONFIG_DEFAULTS["retain_rounds"],
                   help="keep the snapshots and plans of this many last rounds (default %(default)s)")
    i.add_argument("--audit-keep", type=int, default=_CONFIG_DEFAULTS["audit_keep"],
                   help="audit records kept in Redis; 0 (default) keeps the stream complete")
    i.add_argument("--audit-export", default="", metavar="FILE",
                   help="JSONL file older audit records go to before trimming: a regular file inside --audit-dir")
    i.add_argument("--max-pause-bytes", type=int, default=_CONFIG_DEFAULTS["max_pause_bytes"],
                   help="bytes a rank writes into its live slots at one safe point: a swap is applied in chunks of "
                        "whole layers within it, one chunk per step (0 = no byte limit; default %(default)s)")
    i.add_argument("--layers-per-safe-point", type=int, default=_CONFIG_DEFAULTS["layers_per_safe_point"],
                   help="most changed layers switched at one safe point (0 = no limit; with --max-pause-bytes 0 "
                        "a swap is applied at one safe point)")
    for name, default in _DEADLINE_DEFAULTS.items():
        i.add_argument(*deadline_flags(name), dest=name, type=int, default=default, metavar="MS",
                       help=f"deadlines.{name} (default {default})")
    layers = i.add_mutually_exclusive_group()
    layers.add_argument("--layer-ids", default=None, metavar="IDS",
                        help="model layer of every MoE layer, ascending: '3-60' or '3,4,5' (DeepSeek-V3: 3-60); "
                             "exports then write SGLang's row per model layer and TensorRT-LLM's model layer keys")
    layers.add_argument("--first-moe-layer", type=int, default=None, metavar="K",
                        help="the MoE layers are model layers K..K+num_layers-1 (DeepSeek-V3: 3)")
    i.add_argument("--num-model-layers", type=int, default=0, metavar="N",
                   help="model layers, dense ones included (default: the largest layer id + 1)")
    i.add_argument("--adopt-wait-ms", type=int, default=None, metavar="MS",
                   help="a cluster with no records (Redis lost its data): wait up to MS for the live ranks to "
                        f"report the placement they hold, and adopt it when they agree (default: {ADOPT_WAIT_MS}, "
                        "the agents' default heartbeat TTL + TTL/4, counted from Redis' start: a Redis up for longer "
                        "is waited on only once a rank reported; given: MS from now, e.g. after a FLUSHALL or a "
                        "failover); 0: no wait and no adoption, the initial placement is written and every live "
                        "rank loads it")
    i.set_defaults(handler=run_init)

    p = sub.add_parser("coordinator", help="run a coordinator for a cluster (one leads, others stand by)",
                       description="Run a coordinator next to the workers. Several may run: one holds the lease "
                                   "and drives the cluster machine, the others take over when its lease lapses.",
                       parents=[cluster_parent(), audit_dir_parent()])
    p.add_argument("--holder", default=None, help="holder id (default coordinator@host:pid:random)")
    p.add_argument("--lease-ms", type=int, default=3_000, help="lease time to live in ms (default 3000)")
    p.add_argument("--interval", type=float, default=None, metavar="SECONDS",
                   help="also consider a round every SECONDS on the ranks' published windows (skipped, audited, "
                        "when balanced enough or the planned gain is at most min_gain)")
    p.add_argument("--min-balancedness", type=float, default=None,
                   help="periodic rounds are skipped at or above this mean balancedness (SGLang's "
                        "eplb_min_rebalancing_utilization_threshold)")
    p.add_argument("--redis-wait-s", type=float, default=300.0,
                   help="wait this long for Redis to answer at start-up (default %(default)s s)")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(handler=run_coordinator)

    r = sub.add_parser("rearrange", help="ask the cluster's coordinator for one rearrangement round",
                       description="Request a rearrangement round (FastDeploy's rearrange_experts), with --plan FILE "
                                   "one audited round to that placement (no gain gate), or with --commit PLAN_ID "
                                   "allow a cordoned cluster's staged plan to commit.",
                       parents=[cluster_parent()])
    which = r.add_mutually_exclusive_group()
    which.add_argument("--commit", metavar="PLAN_ID", default=None,
                       help="commit this staged plan of a cordoned cluster (shown by `fdeplb status`)")
    which.add_argument("--plan", metavar="FILE", default=None,
                       help="a placement file (fdeplb, sglang, trtllm, fastdeploy; e.g. `fdeplb rebalance --out`): "
                            "the round goes to it without the gain gate (committing it is the operator's decision; "
                            "`rebalance`'s gate line is advice), audited as an operator's plan with its routing "
                            "digest (the round reports its own plan id); refused "
                            "(exit 2, nothing changed) for another shape, a logical expert it lacks or one left "
                            "on non-members only; exit 3 while a round is in flight")
    r.add_argument("--reason", default="operator",
                   help="why (at most 500 characters; kept with the request: `status --json` shows it as "
                        "requested_reason, and the round_requested event; default %(default)s)")
    r.add_argument("--wait", action="store_true",
                   help="wait for the requested round to end: exit 0 if it rearranged or was skipped (nothing worth "
                        "moving), 1 if it aborted, 6 on timeout, 7 if Redis is away as the timeout passes (a shorter "
                        "outage is waited out, said once on stderr). On a cordoned cluster it ends when the round is "
                        "staged (exit 0; prints the plan and the --commit command); with --commit, when the "
                        "committed round is over")
    r.add_argument("--timeout", type=positive_float, default=300.0,
                   help="seconds --wait waits (default %(default)s)")
    r.set_defaults(handler=run_rearrange)


def run_coordinator(args: argparse.Namespace) -> int:
    from fdeplb.cli._common import open_store
    from fdeplb.log import configure
    from fdeplb.orchestration.coordinator import Coordinator
    from fdeplb.orchestration.leadership import check_holder

    from fdeplb.errors import InputError

    configure(args.log_level)
    if not 300 <= args.lease_ms <= 3_600_000:  # before waiting for Redis: a bad option fails at once
        raise InputError(f"lease_ms must be an integer in [300, 3600000], got {args.lease_ms!r}")
    if args.holder is not None:
        check_holder(args.holder)
    wait_for_redis(args.redis_url, args.cluster, args.redis_wait_s, "coordinator")
    store = open_store(args.redis_url, args.cluster)
    cfg = store.read_config()
    from fdeplb.store.audit_export import check_trimming

    check_trimming(cfg.audit_keep, cfg.audit_export_path, args.audit_dir)  # refused at start, not at a round's end
    coordinator = Coordinator(store, args.holder, lease_ms=args.lease_ms, interval_s=args.interval,
                              min_balancedness=args.min_balancedness, audit_dir=args.audit_dir)

    def stop(_signum, _frame):
        coordinator.stop_event.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    coordinator.run()
    if coordinator.deleted is not None:  # an operator deleted the cluster: say so, exit 0 (stopped as asked)
        print(f"stopped: {coordinator.deleted.text(args.cluster)}", file=sys.stderr, flush=True)
    return 0


def wait_for_redis(url: str, cluster: str, timeout_s: float, who: str) -> None:
    """Block until Redis at ``url`` answers (at most ``timeout_s`` s, a log line when it does not at first);
    :class:`RedisUnavailableError` after that, :class:`InputError` for a bad bound."""
    import math

    import structlog

    from fdeplb.errors import InputError
    from fdeplb.store import Store

    if not math.isfinite(timeout_s) or timeout_s < 0:
        raise InputError(f"--redis-wait-s must be a finite number >= 0, got {timeout_s}")
    log = structlog.get_logger(f"fdeplb.{who}")
    Store(url, cluster).wait_available(
        timeout_s, lambda err: log.warning("waiting for redis", url=url, timeout_s=timeout_s, error=err))


def run_rearrange(args: argparse.Namespace) -> int:
    from fdeplb.cli._common import open_store
    from fdeplb.store.records import check_request_reason

    store = open_store(args.redis_url, args.cluster)
    if args.commit:
        cursor = store.cursor()  # before the request: the round's end is never missed
        target = store.read_cluster().round
        store.request_commit(args.commit, by="cli")  # checks that round `target` is LOAD_SUCC with this plan
        print(f"commit of plan {args.commit} requested")
        if not args.wait:
            return 0
        with _interrupted_says(args.redis_url, store.cluster, target, f"plan {args.commit}", pending=False):
            return wait_for_round(store, target, cursor, args.timeout, store_url=args.redis_url)
    check_request_reason(args.reason)  # before a plan is supplied: the request keeps it (exit 2, nothing written)
    plan = None
    if args.plan:  # a bad plan is refused before anything else (nothing written, whether a coordinator runs or not)
        from fdeplb.orchestration.rollback import check_operator_plan, supply_operator_plan

        plan = check_operator_plan(store, _plan_of(store.read_config(), args.plan))
    holder = _wait_for_lease(store, args.timeout if args.wait else min(5.0, args.timeout))
    cursor = store.cursor()
    digest = supply_operator_plan(store, plan, args.plan) if plan is not None else ""
    if digest:  # not a plan_id: the round's hashes its load too; its `load` record names this digest
        print(f"plan from {args.plan} supplied: routing digest {digest} (the round's audit names it; the round's "
              f"plan id, which also hashes the round's load, differs)")
    target = store.request_round(args.reason)  # requests coalesce: the round that will serve this one
    print(f"round {target} will serve this request{'' if digest else _supplied_for(store, target)}; "
          f"coordinator {holder}")
    if not args.wait:
        blocker = start_blockers(store)
        if blocker:
            print(f"note: round {target} {blocker}", file=sys.stderr)
        return 0
    cordoned = store.read_config().cordoned
    with _interrupted_says(args.redis_url, store.cluster, target,
                           f"the plan with routing digest {digest}" if digest else ""):
        code = wait_for_round(store, target, cursor, args.timeout, redis_url=args.redis_url if cordoned else None,
                              store_url=args.redis_url)
    if plan is not None and code == 0 and not cordoned and \
            not np.array_equal(store.current_placement().phy2log, plan):  # a membership round went first
        print(f"round {target} did not go to the plan (a round re-placing a rank's experts went first): the plan "
              f"is dropped; supply it again")
        return 1
    return code


def _supplied_for(store, target: int) -> str:
    """", but it goes to ..." when round ``target`` goes to a placement supplied before this request (an operator's
    plan staged by another ``rearrange --plan``, or a rollback) rather than to a plan of the load, else "": the
    request coalesced into that round, which plans no load of its own."""
    from fdeplb.errors import FdeplbError
    from fdeplb.machines.tables import ClusterState
    from fdeplb.rounds import reasons

    try:  # advice read after the request was made: a record that does not read costs the note, not the exit code
        supplied = store.supplied_placement()
        facts = None if supplied is None else reasons.supplied_of({"supplied": supplied[1]})
        what = None if facts is None else reasons.supplied_round(**facts).text
        if what is None or facts["undoes"] + 1 != target:
            return ""
        pending = store.read_cluster().state is ClusterState.FREE  # a request only: `round cancel` withdraws it
    except (FdeplbError, ValueError, KeyError, TypeError):
        return ""  # the round drops a placement nobody can read and plans as usual
    cancel = " (`fdeplb round cancel` withdraws both)" if facts["kind"] == "operator" and pending else ""
    return f", but it goes to the placement supplied for it, not to a plan of the load: {what}{cancel}"


@contextlib.contextmanager
def _interrupted_says(redis_url: str, cluster: str, target: int, what: str, pending: bool = True):
    """Ctrl-C during ``rearrange --wait`` (a request, ``--plan`` or ``--commit``) ends the wait, not the round: the
    one line on stderr that says so, names the round and ``what`` it goes to, and how to stop it (``round cancel``
    while the request is ``pending``, ``round abort``); the KeyboardInterrupt goes on (exit 130)."""
    try:
        yield
    except KeyboardInterrupt:
        flags = f"--redis-url {redis_url} --cluster {cluster}"
        cancel = (f"`fdeplb round cancel {flags}` withdraws it before it starts" + (" (the plan with it)" if what
                  else "") + ", ") if pending else ""
        print(f"interrupted: round {target} still goes on" + (f" to {what}" if what else "") +
              f"; {cancel}`fdeplb round abort {flags}` ends it before its commit point", file=sys.stderr)
        raise


def _plan_of(cfg: ClusterConfig, path: str):
    """The placement of the plan file at ``path`` (``--initial``, ``--plan``) for a cluster configured as ``cfg``:
    int64 [L, P]. A file of one row per MoE layer is taken as it is; one that names its rows' model layers
    (fdeplb's ``layer_ids``, TensorRT-LLM's layer keys) gives the rows of the cluster's model layers
    (:attr:`ClusterConfig.model_layer_ids`); an SGLang or FastDeploy file (one row per model layer, no ids) must
    have the cluster's model-layer count. :class:`PlacementFileError` / :class:`InputError` for a file that does not
    read, whose header names another topology (expert, GPU, node or group count), or whose rows cannot be matched to
    the cluster's layers (another model's plan, or a cluster created without ``--layer-ids``: its first rows would
    be taken); the message names both row counts and the fix."""
    from fdeplb.errors import InputError
    from fdeplb.placement import read_placement

    read = read_placement(path, num_logical_experts=cfg.num_logical_experts, num_gpus=cfg.ep_size,
                          num_groups=cfg.num_groups, num_nodes=cfg.num_nodes,
                          num_physical_experts=cfg.num_physical_experts)
    rows = read.placement.num_layers
    if rows == cfg.num_layers:
        return read.placement.phy2log
    ids = cfg.model_layer_ids
    named = read.format in ("fdeplb", "trtllm")  # the file says which model layer each row is
    if named and np.isin(ids, read.layer_ids).all() or not named and rows == cfg.model_layers:
        return read.for_layers(ids).phy2log
    missing = np.setdiff1d(ids, read.layer_ids).tolist() if named else []
    which = (f"model layers {read.layer_ids[0]}-{read.layer_ids[-1]}" + (f", none for {missing[:5]}" if missing
                                                                          else "")) if named else \
        f"{read.format}: one per model layer, no layer ids"
    layers = f"{cfg.num_layers} MoE layers, model layers {ids[0]}-{ids[-1]} of {cfg.model_layers}"
    write = ("write the plan with one row per MoE layer, or in fdeplb format (`fdeplb rebalance --format fdeplb`: "
             "its layer_ids name the rows)")
    why = (f"taken as its model layers since it was created without --layer-ids: the rows cannot be matched. "
           f"{write[0].upper()}{write[1:]}, or create the cluster with --layer-ids (or --first-moe-layer) and "
           f"--num-model-layers naming the model's layers (fixed at creation)" if not cfg.layer_ids else
           f"a plan of another model? Else {write}")
    raise InputError(f"{path}: {rows} layer rows ({which}); the cluster has {layers}, {why}")


def _wait_for_lease(store, timeout_s: float) -> str:
    """The coordinator lease holder, waiting up to ``timeout_s`` for one (a coordinator just started takes its lease
    within a moment). :class:`StateError` when none holds it: nothing is requested then."""
    import time

    from fdeplb.errors import StateError

    end = time.monotonic() + timeout_s
    while True:
        holder = store.lease_info().holder
        if holder:
            return holder
        if time.monotonic() > end:
            raise StateError(f"no coordinator holds the lease of cluster {store.cluster}, so no round would start: "
                             f"nothing requested. Start one: fdeplb coordinator --redis-url URL --cluster "
                             f"{store.cluster}")
        time.sleep(0.2)


def wait_for_round(store, target: int, cursor, timeout_s: float, redis_url: str | None = None,
                   store_url: str | None = None) -> int:
    """Follow the audit from ``cursor`` until round ``target`` is back in FREE; print its outcome (rearranged with
    balancedness before/after and moved experts; skipped or aborted with the reason; a probe mismatch with the
    ranks, layers and the rollback round). Returns 0 for rearranged or skipped, 1 for aborted or for a request
    withdrawn before it started (expired past ``deadlines.request_ttl_ms``, or cancelled), 4 (a weights error's
    exit code, :class:`~fdeplb.errors.VerificationError`) for a round that swapped but whose output probe failed on
    some rank (:attr:`~fdeplb.rounds.reasons.RoundOutcome.PROBE_MISMATCH`, rolled back by the next round);
    :class:`DeadlineError` (exit 6) after ``timeout_s`` seconds.

    While the round has not started, why not (:func:`start_blockers`: stale ranks as the coordinator's refusal
    records them, no coordinator holding the lease, weights not NORMAL) is printed on stderr as soon as the records
    show it (again when it changes) and named in the timeout's message.

    Redis going away meanwhile (restarted, failed over) does not end the wait: every read rides the outage out
    (:func:`fdeplb.backoff.ride_out`: the house back-off, ``note: Redis at URL unavailable, retrying for up to N s``
    on stderr once per outage) within what is left of ``timeout_s``; :class:`RedisUnavailableError` (exit 7) when
    Redis is still away as the time runs out. A frozen Redis (no reply) costs a read a quarter of ``timeout_s`` at
    most (3 s at least: the longest ``XREAD BLOCK`` and its reply), so the wait ends that long past it at most.

    ``redis_url`` (given for a cordoned cluster, whose rounds wait in LOAD_SUCC for an operator's commit): also stop,
    returning 0, once round ``target`` (or a later one) is staged, and print its plan (balancedness before/after,
    moved experts) and the ``rearrange --commit`` command that commits it.

    ``store_url``: the ``--redis-url`` the store was opened with; the timeout's message suggests
    ``fdeplb status --redis-url <store_url> --cluster <id>`` (``URL`` when not given)."""
    import time

    from fdeplb.backoff import ride_out
    from fdeplb.errors import DeadlineError, RedisUnavailableError, VerificationError, exit_code
    from fdeplb.machines.tables import CLUSTER, ClusterState
    from fdeplb.rounds.reasons import RoundOutcome, detail_of, round_outcome
    from fdeplb.store import Store
    from fdeplb.store.connection import SOCKET_TIMEOUT_S

    end = time.monotonic() + timeout_s
    status_hint = f"fdeplb status --redis-url {store_url or 'URL'} --cluster {store.cluster}"
    # each read awaits its reply a quarter of the wait at most (the store's 30 s otherwise): a frozen Redis holds
    # the wait only seconds past its --timeout, not 30 s past it
    store = Store(store.url, store.cluster, socket_timeout_s=min(SOCKET_TIMEOUT_S, timeout_s / 4))

    def retried(call):
        try:
            return ride_out(call, what=f"Redis at {store_url or store.url}", retry_s=end - time.monotonic())
        except RedisUnavailableError as err:
            raise RedisUnavailableError(f"{err}; --timeout {timeout_s:g}s passed before round {target} was seen "
                                        f"to end, it may still finish: {status_hint}") from None

    last = None
    shown = ""
    seen: dict = {}  # (round, trigger) -> the round's swapped / load record, for its outcome
    while last is None:
        rec = retried(store.read_cluster)  # each pass: a round staged, or a refusal written, before the cursor too
        if redis_url is not None and rec.state is ClusterState.LOAD_SUCC and rec.round >= target and rec.plan_id:
            return retried(lambda: _print_staged(store, rec, redis_url))
        blocker = retried(lambda: start_blockers(store, rec)) \
            if rec.state is ClusterState.FREE and rec.round < target else ""
        if blocker and blocker != shown:
            print(f"note: round {target} {blocker}", file=sys.stderr, flush=True)
        shown = blocker or shown
        left = end - time.monotonic()
        if left <= 0:
            raise DeadlineError(f"round {target} not over after {timeout_s:g}s (cluster {rec.state}, round "
                                f"{rec.round}{'; it ' + blocker if blocker else ''}); it may still finish: "
                                f"{status_hint}")
        for a in retried(lambda: store.wait(cursor, int(min(left, 1.0) * 1000) + 1)):
            if a["machine"] == CLUSTER.name and a["trigger"] in WITHDRAWN and \
                    (detail_of(a) or {}).get("round", -1) >= target:
                print(f"round {target}: not started: {a['reason']}")
                return 1
            if a["machine"] != CLUSTER.name or not a["round"].isdigit() or int(a["round"]) < target:
                continue
            if a["trigger"] in ("swapped", "load"):
                seen[(a["round"], a["trigger"])] = a
            if a["to"] == ClusterState.FREE and a["from"] != ClusterState.FREE:
                last = a
                break
    outcome, reason = round_outcome(last, seen.get((last["round"], "swapped")), seen.get((last["round"], "load")))
    if outcome is RoundOutcome.REARRANGED:
        plan_id = last["plan_id"] or retried(store.current_placement).plan_id
        plan = retried(lambda: store.read_plan(plan_id)) if plan_id else None
        if plan is None:
            print(f"round {last['round']}: rearranged (plan {last['plan_id'] or '?'})")
        else:
            print(f"round {last['round']}: rearranged, plan {plan.plan_id}: {_plan_numbers(plan)}")
        return 0
    print(f"round {last['round']}: {outcome.value}: {reason}")
    if outcome is RoundOutcome.PROBE_MISMATCH:  # swapped, but the model's outputs changed: a weights failure
        return exit_code(VerificationError(reason))
    return 0 if outcome is RoundOutcome.SKIPPED else 1


def start_blockers(store, rec=None) -> str:
    """Why a requested round cannot start now, as the end of a sentence ("waits: ..."), or "": the leading
    coordinator's refusal recorded in the cluster record (stale ranks), no coordinator holding the lease (nobody
    would start it), ranks whose weights are not NORMAL (cleared or being updated; the start's guard)."""
    from fdeplb.machines.tables import WEIGHTS, WeightState
    from fdeplb.rounds.reasons import REFUSED

    rec = rec or store.read_cluster()
    why = []
    if rec.reason.startswith(REFUSED):
        why.append(rec.reason)
    if not store.lease_info().holder:
        why.append(f"no coordinator holds the lease of cluster {store.cluster} (start one: fdeplb coordinator "
                   f"--redis-url URL --cluster {store.cluster})")
    off = [(r, w.state) for r, w in enumerate(store.read_all(WEIGHTS)) if w.state is not WeightState.NORMAL]
    if off:
        ranks = ", ".join(f"{r} {state}" for r, state in off)
        why.append(f"weights not NORMAL on ranks {ranks}; it starts once they are (GET /update_model_weight "
                   f"reloads cleared weights)")
    return "waits: " + "; ".join(why) if why else ""


def _plan_numbers(plan) -> str:
    return (f"balancedness {plan.balancedness_before:.4f} -> {plan.balancedness_after:.4f} "
            f"(gain {plan.balancedness_after - plan.balancedness_before:+.4f}), {plan.moved_experts} moved experts")


def _print_staged(store, rec, redis_url: str) -> int:
    from fdeplb.status import commit_command

    plan = store.read_plan(rec.plan_id)
    numbers = "" if plan is None else f": {_plan_numbers(plan)}"
    print(f"round {rec.round}: staged, plan {rec.plan_id}{numbers}; the cluster is cordoned: it commits on "
          f"{commit_command(redis_url, store.cluster, rec.plan_id)}")
    return 0


def check_checkpoint(path: str, preset: str, num_layers: int, num_logical_experts: int) -> None:
    """Check that the checkpoint at ``path`` exists and holds every tensor of every expert of ``num_layers`` x
    ``num_logical_experts`` under the ``preset`` names, all experts alike in shape and dtype (safetensors headers
    only, no tensor data read). :class:`CheckpointError` (exit 4) naming the first missing or odd tensor,
    :class:`InputError` for an unknown preset."""
    from fdeplb.weights.checkpoint import CheckpointReader

    with CheckpointReader(path, preset) as reader:
        for layer in range(num_layers):
            for expert in range(num_logical_experts):
                reader.check_expert(layer, expert)


def layer_ids_of(text: str | None, first: int | None, num_layers: int) -> list[int]:
    """``--layer-ids`` ('3-60', '3,4,5', '0-2,5') or ``--first-moe-layer`` as a list of model layer ids ([] when
    neither is given: the rows are model layers 0..L-1). :class:`InputError` for a bad list."""
    from fdeplb.errors import InputError

    if first is not None:
        if first < 0:
            raise InputError(f"--first-moe-layer must be >= 0, got {first}")
        return list(range(first, first + num_layers))
    if text is None:
        return []
    ids: list[int] = []
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            ids += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
    except ValueError:
        ids = []
    if not ids or any(a >= b for a, b in zip(ids, ids[1:])) or min(ids) < 0:  # '60-3' is an empty range
        raise InputError(f"--layer-ids {text[:60]!r}: expected ascending ids like '3-60' or '3,4,5'")
    return ids


def run_init(args: argparse.Namespace) -> int:
    from fdeplb.errors import InputError
    from fdeplb.orchestration.cluster_setup import init_cluster
    from fdeplb.placement import initial_placement
    from fdeplb.store import Store

    if args.num_redundant_experts < 0:
        raise InputError(f"--num-redundant-experts must be >= 0, got {args.num_redundant_experts}")
    if args.adopt_wait_ms is not None and args.adopt_wait_ms < 0:
        raise InputError(f"--adopt-wait-ms must be >= 0, got {args.adopt_wait_ms}")
    for name in _DEADLINE_DEFAULTS:
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1")
    export = args.audit_export
    if export:  # inside --audit-dir, a regular file (or none yet); stored as its absolute path
        from fdeplb.store.audit_export import check_export_path

        export = check_export_path(export, args.audit_dir)
    import os

    checkpoint = os.path.abspath(args.checkpoint)  # a relative path would be read from each rank's cwd
    config = ClusterConfig(
        num_layers=args.num_layers, num_logical_experts=args.num_logical_experts,
        num_physical_experts=args.num_logical_experts + args.num_redundant_experts, ep_size=args.ep_size,
        num_nodes=args.num_nodes, num_groups=args.num_groups, policy=args.policy,
        checkpoint={"path": checkpoint, "preset": args.preset}, cordoned=args.cordoned,
        min_gain=args.min_gain, retain_rounds=args.retain_rounds, audit_keep=args.audit_keep,
        audit_export_path=export, max_pause_bytes=args.max_pause_bytes,
        layers_per_safe_point=args.layers_per_safe_point,
        deadlines=Deadlines(**{name: getattr(args, name) for name in _DEADLINE_DEFAULTS}),
        layer_ids=layer_ids_of(args.layer_ids, args.first_moe_layer, args.num_layers),
        num_model_layers=args.num_model_layers,
    )
    if args.initial:
        phy2log = _plan_of(config, args.initial)
    else:
        phy2log = initial_placement(args.num_layers, args.num_logical_experts,
                                    config.num_physical_experts).phy2log
    check_checkpoint(checkpoint, args.preset, args.num_layers, args.num_logical_experts)
    store = Store(args.redis_url, args.cluster)
    store.ping()
    wait_ms = ADOPT_WAIT_MS if args.adopt_wait_ms is None else args.adopt_wait_ms
    created = init_cluster(store, config, phy2log, adopt=wait_ms > 0, adopt_wait_ms=wait_ms,
                           since_start=args.adopt_wait_ms is None, say=print)
    print(f"cluster {args.cluster}: {'created' if created else 'exists already, left as it is'} "
          f"({config.ep_size} ranks x {config.slots_per_rank} slots, {config.num_layers} MoE layers)")
    adopted = store.current_placement().plan_id if created else ""
    if adopted:  # created over live ranks (Redis lost the cluster's data): their placement, not the initial one
        print(f"cluster {args.cluster}: adopted the placement the live ranks hold (plan {adopted})")
    return 0
