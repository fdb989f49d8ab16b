"""``fdeplb load --export FILE``: a running cluster's published load windows, summed over the ranks its placement
is routed over, written as an SGLang expert-load dump that ``fdeplb rebalance --load`` reads (the record step of
the offline workflow: record -> plan -> validate -> commit, README "Offline plans")."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from fdeplb.options import cluster_parent


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("load", help="export a cluster's published load windows as an expert-load dump",
                       description="Sum the last published expert_load window of every rank the placement is routed "
                                   "over and write it as SGLang's dump {\"logical_count\": [model layers][experts]} "
                                   "(dense layers' rows zero), which `fdeplb rebalance --load` reads.",
                       parents=[cluster_parent()])
    p.add_argument("--export", required=True, metavar="FILE", help="the dump to write (JSON)")
    p.set_defaults(handler=run_load)


def summed_windows(store) -> tuple[np.ndarray, list[int], list[int]]:
    """(expert_load int64 [L, E] summed over the routed members' last windows, the ranks summed, the routed ranks
    with no window yet). :class:`StateError` when no routed rank published one; :class:`CorruptRecordError` for a
    window that does not parse."""
    from fdeplb.errors import StateError

    cfg = store.read_config()
    routed = store.current_placement().live_ranks(cfg.ep_size)
    windows = {r: store.read_load(r) for r in routed}
    summed = [r for r, w in windows.items() if w is not None]
    if not summed:
        raise StateError(f"no rank of cluster {store.cluster} the placement is routed over ({list(routed)}) has "
                         f"published a load window yet: nothing to export")
    load = np.sum(np.stack([windows[r].expert_load for r in summed]), axis=0, dtype=np.int64)
    return load, summed, [r for r in routed if windows[r] is None]


def run_load(args: argparse.Namespace) -> int:
    from fdeplb.cli._common import check_out_folder, open_store
    from fdeplb.errors import StateError
    from fdeplb.placement.loads import load_digest

    check_out_folder("--export", args.export)
    store = open_store(args.redis_url, args.cluster)
    cfg = store.read_config()
    load, summed, missing = summed_windows(store)
    idle = np.flatnonzero(~load.any(axis=1)).tolist()
    if idle:  # SGLang's reader takes an all-zero row for a dense layer: the plan would leave the layer out
        raise StateError(f"MoE layers {idle[:10]} routed no token in the published windows: the dump would read "
                         f"them as dense layers; export again once they have load")
    rows = np.zeros((cfg.model_layers, cfg.num_logical_experts), dtype=np.int64)
    rows[cfg.model_layer_ids] = load
    try:
        with open(args.export, "w") as f:
            json.dump({"logical_count": rows.tolist()}, f)
    except OSError as err:
        from fdeplb.errors import InputError

        raise InputError(f"--export {args.export}: cannot write: {err.strerror}") from None
    if missing:
        print(f"note: ranks {missing} have published no window yet: left out of the sum", file=sys.stderr)
    print(f"wrote the load of ranks {summed} ({cfg.num_layers} MoE layers x {cfg.num_logical_experts} experts, "
          f"{int(load.sum()):,} tokens, digest {load_digest(load)}) to {args.export}")
    return 0
