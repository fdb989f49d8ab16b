"""``fdeplb rebalance``: plan a placement from an expert-load dump and show what it changes."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from fdeplb.errors import InputError
from fdeplb.store import ClusterConfig
from fdeplb.placement import (
    check_topology,
    FORMATS,
    POLICIES,
    balancedness,
    gpu_loads,
    imbalance,
    initial_placement,
    moved_experts,
    read_expert_load,
    read_placement,
    rebalance_experts,
    write_placement,
)
from fdeplb.placement.files import check_placement_path


#: a new cluster's min_gain (:class:`ClusterConfig`'s default): the gate line's threshold unless --min-gain is given
_DEFAULT_MIN_GAIN = ClusterConfig.min_gain


def register(subparsers) -> None:
    """Add the ``rebalance`` subcommand."""
    p = subparsers.add_parser(
        "rebalance",
        help="compute an expert placement from a load dump",
        description="Compute an expert placement from an expert-load dump (SGLang logical_count or counts JSON) "
        "and print balancedness, imbalance, max GPU load and moved experts before and after. 'Before' is the "
        "--old placement, or the trivial one (slot p holds expert p mod E).",
    )
    p.add_argument("--load", required=True, metavar="FILE", help="expert-load dump (JSON; gzip when named .gz)")
    p.add_argument("--num-replicas", required=True, type=int, metavar="R", help="slots per layer (physical experts)")
    p.add_argument("--num-groups", type=int, default=1, metavar="G", help="expert groups (DeepSeek-V3: 8)")
    p.add_argument("--num-nodes", type=int, default=1, metavar="N", help="server nodes")
    p.add_argument("--num-gpus", required=True, type=int, metavar="GPUS", help="EP size (ep_size)")
    p.add_argument("--policy", default="deepseek", choices=sorted(POLICIES),
                   help="placement policy (default %(default)s)")
    p.add_argument("--old", metavar="PLACEMENT",
                   help="current placement file (any supported format); its rows are matched to --load's by model "
                        "layer, refused when they cannot be (e.g. a --load without dense rows and a --old of "
                        "another row count)")
    p.add_argument("--out", metavar="FILE", help="write the new placement here")
    p.add_argument("--format", default="fdeplb", choices=FORMATS, help="format of --out")
    p.add_argument("--plot", metavar="PNG", help="write a per-layer x per-GPU load heatmap, before and after")
    p.add_argument("--tolerance", type=float, default=None,
                   help="move_aware: allowed max/mean excess over balanced, mean over layers (each layer <= 2x); "
                        "topology_aware: the balance slack every layer may spend on keeping tokens on their node "
                        "(default 0.0005 for both); refused with another policy, which would ignore it")
    p.add_argument("--max-moved-experts", type=int, default=None, help="move_aware: cap on moved experts")
    p.add_argument("--min-gain", type=float, default=_DEFAULT_MIN_GAIN, metavar="G",
                   help="the gate line's threshold: the least balancedness gain a cluster's round goes on for, in "
                        "[0, 1]; give the cluster's (`fdeplb config show`) to judge the plan as its rounds would "
                        "(default %(default)s, a new cluster's)")
    p.set_defaults(handler=run)


def _row(label: str, load: np.ndarray, phy2log: np.ndarray, num_gpus: int, moved: int) -> list[str]:
    return [
        label,
        f"{balancedness(load, phy2log, num_gpus).mean():.4f}",
        f"{imbalance(load, phy2log, num_gpus).mean():.4f}",
        f"{gpu_loads(load, phy2log, num_gpus).max():,.0f}",
        f"{moved:,}",
    ]


def _source_load(dump, num_gpus: int) -> tuple[np.ndarray | None, int]:
    """(the load per source rank, float or int [L, num_gpus, E] over ``dump``'s MoE rows, when its file is SGLang's
    per-rank ``logical_count`` stack [num_gpus, model layers, E] (what ``fdeplb load --export`` writes), else None;
    the number of source ranks the file stacks, 0 for a summed dump). :class:`LoadFileError` for a stack with a
    negative count (its sum, which the dump's reader checked, may hide it)."""
    from fdeplb.errors import LoadFileError
    from fdeplb.placement.documents import read_document

    if dump.format != "sglang" or Path(dump.path).suffix in (".yaml", ".yml"):
        return None, 0
    # read_expert_load checked this file and keeps only the sum; read again for the split (an ExpertLoad that kept
    # the per-rank stack would spare this: fdeplb.placement.loads), by the same reader (a regular file, size-capped)
    doc = read_document(dump.path, LoadFileError, "expert-load file")
    rows = doc.get("logical_count") if isinstance(doc, dict) else None
    arr = np.asarray(rows) if isinstance(rows, list) else np.zeros(0)
    if arr.ndim != 3:
        return None, 0
    negative = np.argwhere(arr < 0)
    if negative.size:
        r, layer, e = (int(i) for i in negative[0])
        raise LoadFileError(f"{dump.path}: logical_count has a negative value {arr[r, layer, e]} at [rank {r}, layer "
                            f"{layer}, expert {e}]")
    if arr.shape[0] != num_gpus:
        return None, arr.shape[0]
    return np.ascontiguousarray(np.moveaxis(arr, 0, 1)[dump.layer_ids]), num_gpus


def _old_rows(old, dump):
    """The rows of ``old`` (a :class:`~fdeplb.placement.PlacementFile`) for ``dump``'s MoE layers (an
    :class:`~fdeplb.placement.ExpertLoad`), as a Placement [L, P]: the file itself when both name the same layers,
    else its rows picked by model layer, which only a load that names its model layers allows (one whose file had
    dense rows: its rows are the model's). Never by position when the row counts differ: a 58-row load of a
    cluster created without ``--layer-ids`` against SGLang's 61-row placement of the same model would take rows
    0-57, every MoE layer shifted by the 3 dense ones. :class:`InputError` naming both row counts and the fix when
    the rows cannot be matched."""
    if np.array_equal(old.layer_ids, dump.layer_ids):
        return old.placement
    names_layers = dump.num_model_layers > dump.num_layers  # dense rows dropped: the rows are model layers
    if names_layers and np.isin(dump.layer_ids, old.layer_ids).all():
        return old.for_layers(dump.layer_ids)
    span = (lambda ids: f"{ids[0]}-{ids[-1]}" if len(ids) else "none")
    load_says = (f"model layers {span(dump.layer_ids)} of {dump.num_model_layers}" if names_layers else
                 "no dense rows: which model layers they are is not known")
    missing = np.setdiff1d(dump.layer_ids, old.layer_ids).tolist() if names_layers else []
    raise InputError(
        f"--old {old.path} ({old.format}) has {len(old.layer_ids)} layer rows (model layers "
        f"{span(old.layer_ids)}), --load {dump.path} has {dump.num_model_layers} rows, {dump.num_layers} with load "
        f"({load_says}): the rows cannot be matched layer by layer"
        + (f" (no --old row for model layers {missing[:5]})" if missing else "") +
        ". Give --old and --load of the same cluster (`fdeplb status --placement-out` and `fdeplb load --export` "
        "write the same rows), a --old with one row per row of --load, or a --load with the model's rows: a "
        "cluster created with --layer-ids (or --first-moe-layer) exports one row per model layer, dense rows zero")


def run(args: argparse.Namespace) -> int:
    """Plan, print the before/after table, and write --out / --plot."""
    from fdeplb.cli._common import check_out_folder

    for flag, path in (("--out", args.out), ("--plot", args.plot)):
        check_out_folder(flag, path)
    if args.plot:
        from fdeplb.placement.plot import check_plot_path

        check_plot_path(args.plot)  # not after the planning: a .txt is no image
    if args.tolerance is not None and args.policy not in ("move_aware", "topology_aware"):
        raise InputError(f"--tolerance applies to the move_aware and topology_aware policies only; policy "
                         f"{args.policy} ignores it")
    if args.max_moved_experts is not None and args.policy != "move_aware":
        raise InputError(f"--max-moved-experts applies to the move_aware policy only; policy {args.policy} "
                         f"ignores it")
    if args.out:  # before the planning: a trtllm placement is YAML (*.yaml), the others JSON (the readers' rule)
        check_placement_path(args.out, args.format, "--out")
    dump = read_expert_load(args.load)
    if dump.interleaved_dense:
        import sys

        print(f"note: {dump.path}: rows {dump.interleaved_dense} are all zero between MoE rows: read as dense "
              f"layers and dropped (SGLang's convention for interleaved dense layers); if they are MoE layers "
              f"that routed no token, the plan leaves them out", file=sys.stderr)
    load = dump.expert_load
    L, E = dump.expert_load.shape
    check_topology(E, args.num_replicas, args.num_groups, args.num_nodes, args.num_gpus)  # before any allocation
    cfg = ClusterConfig(num_layers=L, num_logical_experts=E, num_physical_experts=args.num_replicas,
                        ep_size=args.num_gpus, num_nodes=args.num_nodes, num_groups=args.num_groups,
                        policy=args.policy, min_gain=args.min_gain)  # the cluster the gate line judges for
    if args.old:
        before = _old_rows(read_placement(args.old, num_logical_experts=E, num_gpus=args.num_gpus,
                                          num_physical_experts=args.num_replicas), dump)
        if before.phy2log.shape != (L, args.num_replicas):
            raise InputError(
                f"{args.old}: placement has shape {before.phy2log.shape}, expected ({L}, {args.num_replicas})"
            )
        before_label = "before (--old)"
    else:
        before = initial_placement(L, E, args.num_replicas, num_gpus=args.num_gpus)
        before_label = "before (trivial)"
    source, ranks = _source_load(dump, args.num_gpus)  # [L, num_gpus, E] when the dump is SGLang's per-rank stack
    if source is None and ranks and args.policy == "topology_aware":
        import sys

        print(f"note: {dump.path} stacks the load of {ranks} source ranks, not --num-gpus {args.num_gpus}: planned "
              f"on their sum (a dump of another cluster?)", file=sys.stderr)
    start = time.perf_counter()
    try:
        after = rebalance_experts(
            source if source is not None and args.policy == "topology_aware" else load,
            args.num_replicas, args.num_groups, args.num_nodes, args.num_gpus, policy=args.policy,
            old_phy2log=before if (args.old or args.policy == "move_aware") else None,
            max_moved_experts=args.max_moved_experts,
            **({} if args.tolerance is None else {"tolerance": args.tolerance}),  # else rebalance_experts' default
        )
    except InputError as err:
        if args.old or "old_phy2log" not in str(err):
            raise
        raise InputError(f"{err} (without --old the old placement is the trivial one, slot p holds expert p mod E: "
                         f"give the cluster's placement with --old)") from None
    elapsed_ms = (time.perf_counter() - start) * 1e3
    moved = moved_experts(before, after, args.num_gpus)
    rows = [
        ["", "balancedness", "imbalance", "max GPU load", "moved experts"],
        _row(before_label, load, before.phy2log, args.num_gpus, 0),
        _row(f"after ({args.policy})", load, after.phy2log, args.num_gpus, moved),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    from fdeplb.sim.demo_driver import plural

    print(
        f"{dump.path}: {L} MoE layers x {E} experts -> {args.num_replicas} slots on {args.num_gpus} GPUs "
        f"({plural(args.num_nodes, 'node')}, {plural(args.num_groups, 'group')}), policy {args.policy}, planned in {elapsed_ms:.1f} ms"
    )
    for r in rows:
        print("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]))
    from fdeplb.rounds.gating import cross_node_figures, decide, keeps_source_load  # the gate a round applies

    # the share of tokens that leave their source rank's node (placement.metrics), mean over layers
    cross_nodes = {} if source is None or args.num_nodes == 1 else cross_node_figures(
        source, before, after, args.num_gpus, args.num_nodes)
    cross = "" if not cross_nodes else (
        f"cross-node fraction {cross_nodes['cross_node_before']:.4f} -> {cross_nodes['cross_node_after']:.4f}")
    if cross:
        print(f"{cross} (load per source rank, {args.num_nodes} nodes)")
    # a cluster's round judges the cross-node fractions only when its policy plans from the split (gating.
    # keeps_source_load): other policies' rounds plan on the sum and are judged on balancedness alone
    gate = decide(load, before.phy2log, after.phy2log, cfg,
                  source_load=source if source is not None and keeps_source_load(cfg) else None)
    lower = gate.cross_node_gain
    print(f"gate: {'goes on' if gate.goes_on else 'skipped'}: " +
          (f"gain {gate.gain:+.4f}" + ("" if lower is None else
                                       f", cross-node fraction {'lower' if lower >= 0 else 'higher'} by "
                                       f"{abs(lower):.4f}") +
           f" with {moved:,} moved experts" if gate.goes_on else
           f"{gate.why_skipped} (a cluster would not run this plan)"))
    if args.out:
        write_placement(
            after, args.out, format=args.format, layer_ids=dump.layer_ids,
            num_model_layers=dump.num_model_layers if args.format in ("sglang", "fastdeploy") else None,
            load_digest=dump.digest, expert_load=load,
        )
        print(f"wrote {args.format} placement to {args.out}")
    if args.plot:
        from fdeplb.placement.plot import plot_gpu_loads

        plot_gpu_loads(
            [(before_label, gpu_loads(load, before, args.num_gpus)),
             (f"after ({args.policy})", gpu_loads(load, after, args.num_gpus))],
            args.plot,
            title=f"{dump.path.rsplit('/', 1)[-1]}: {args.num_replicas} slots on {args.num_gpus} GPUs, "
            f"moved experts {moved:,}" + (f", {cross}" if cross else ""),
        )
        print(f"wrote heatmap to {args.plot}")
    return 0
