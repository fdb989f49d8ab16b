"""``fdeplb load --export FILE``: a running cluster's published load windows, of the ranks its placement is routed
over, written as an SGLang expert-load dump that ``fdeplb rebalance --load`` reads (the record step of the offline
workflow: record -> plan -> validate -> commit, README "Offline plans").

A rank's window counts the tokens that rank routed to every expert: the windows stacked are the load per source
rank, SGLang's per-rank ``logical_count`` [ranks, model layers, experts], which the reader sums and ``rebalance
--policy topology_aware`` plans from as it is."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from fdeplb.options import cluster_parent


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("load", help="export a cluster's published load windows as an expert-load dump",
                       description="Write the last published expert_load window of every rank the placement is "
                                   "routed over as SGLang's per-rank dump {\"logical_count\": [ep_size][model "
                                   "layers][experts]} (the load per source rank; other ranks' and dense layers' rows "
                                   "zero), which `fdeplb rebalance --load` reads.",
                       parents=[cluster_parent()])
    p.add_argument("--export", required=True, metavar="FILE", help="the dump to write (JSON; gzip when named .gz)")
    p.epilog = ("Ranks publish their windows when a round collects (and an EmbeddedAgent every publish_interval_s, "
                "5 s by default): on a fresh cluster run a round first (`fdeplb rearrange --wait`).")
    p.set_defaults(handler=run_load)


def run_load(args: argparse.Namespace) -> int:
    from fdeplb.cli._common import check_out_folder, open_store
    from fdeplb.errors import StateError
    from fdeplb.placement.documents import check_document_name, write_document
    from fdeplb.placement.loads import load_digest
    from fdeplb.status import source_load

    check_out_folder("--export", args.export)
    check_document_name(args.export, "json", "a load dump", f"--export {args.export}")
    store = open_store(args.redis_url, args.cluster)
    cfg = store.read_config()
    try:
        stack, summed, missing = source_load(store)
    except StateError as err:  # a fresh cluster: say what publishes a window
        raise StateError(f"{err}. A rank publishes its window when a round collects (the only time for a "
                         f"RankAgent, the sim worker's) and, with publish_interval_s, also periodically (an "
                         f"EmbeddedAgent: every 5 s by default): run a round first (`fdeplb rearrange --redis-url "
                         f"{args.redis_url} --cluster {args.cluster} --wait`; a skipped one publishes too)") from None
    load = stack.sum(axis=0)
    idle = np.flatnonzero(~load.any(axis=1)).tolist()
    if idle:  # SGLang's reader takes an all-zero row for a dense layer: the plan would leave the layer out
        raise StateError(f"MoE layers {idle[:10]} routed no token in the published windows: the dump would read "
                         f"them as dense layers; export again once they have load")
    rows = np.zeros((cfg.ep_size, cfg.model_layers, cfg.num_logical_experts), dtype=np.int64)
    rows[:, cfg.model_layer_ids] = stack
    write_document(args.export, json.dumps({"logical_count": rows.tolist()}), kind="json", what="a load dump",
                   label=f"--export {args.export}")  # gzip when named *.gz, as the reader expects
    if missing:
        print(f"note: ranks {missing} have published no window yet: left out of the sum", file=sys.stderr)
    print(f"wrote the load of ranks {summed} ({cfg.num_layers} MoE layers x {cfg.num_logical_experts} experts, "
          f"{int(load.sum()):,} tokens, digest {load_digest(load)}) to {args.export}")
    return 0
