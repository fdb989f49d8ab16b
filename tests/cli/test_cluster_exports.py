"""A cluster's placement exports keep the model's layers: with ``init-cluster
--first-moe-layer`` / ``--layer-ids`` stored in the config, ``/v1/placement?format=``, ``status --placement-out`` and a
``rebalance --old`` of that export agree with ``rebalance --format sglang`` on the DeepSeek-V3 dump (61 rows, dense
layers included; TensorRT-LLM keys 3..60), read back with each format's own conventions."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from fdeplb.orchestration.cluster_setup import init_cluster
from fdeplb.placement import initial_placement, read_expert_load, read_placement, rebalance_experts
from fdeplb.store import ClusterConfig, Store
from tests.helpers import run_cli

E, P, GPUS = 256, 288, 32


@pytest.fixture
def dump(real_data):
    return read_expert_load(real_data / "dsv3_sglang_ep_stats" / "decode_in1000out1000.json")


@pytest.fixture
def dsv3(redis_url, cluster_id, dump):
    """A DeepSeek-V3-shaped cluster (58 MoE layers = model layers 3..60) holding a deepseek plan of the dump."""
    assert dump.layer_ids.tolist() == list(range(3, 61)) and dump.num_model_layers == 61
    store = Store(redis_url, cluster_id)
    cfg = ClusterConfig(num_layers=58, num_logical_experts=E, num_physical_experts=P, ep_size=GPUS, num_groups=8,
                        num_nodes=4, layer_ids=list(range(3, 61)))
    plan = rebalance_experts(dump.expert_load, P, 8, 4, GPUS, policy="deepseek").phy2log
    init_cluster(store, cfg, plan)
    yield store, plan
    store.delete_cluster()


def test_status_export_has_sglangs_rows_per_model_layer_and_trtllm_model_keys(dsv3, dump, capsys, tmp_path):
    store, plan = dsv3
    ours = tmp_path / "rebalance.json"
    code, _, err = run_cli(capsys, "rebalance", "--load", dump.path, "--num-replicas", str(P), "--num-groups", "8",
                           "--num-nodes", "4", "--num-gpus", str(GPUS), "--out", str(ours), "--format", "sglang")
    assert code == 0, err
    exported = tmp_path / "cluster.json"
    code, _, err = run_cli(capsys, "status", "--redis-url", store.url, "--cluster", store.cluster,
                           "--placement-out", str(exported), "--format", "sglang")
    assert code == 0, err
    rows = json.loads(exported.read_text())["physical_to_logical_map"]
    assert len(rows) == len(json.loads(ours.read_text())["physical_to_logical_map"]) == 61
    assert np.array_equal(np.asarray(rows)[3:], plan)  # SGLang indexes rows by model layer
    assert np.array_equal(np.asarray(rows)[:3], initial_placement(3, E, P).phy2log)  # dense: trivial, as rebalance
    assert np.array_equal(rows, json.loads(ours.read_text())["physical_to_logical_map"])  # the same plan, same file
    back = read_placement(exported, num_logical_experts=E, num_gpus=GPUS)
    assert np.array_equal(back.for_layers(dump.layer_ids).phy2log, plan)

    trt = tmp_path / "cluster.yaml"
    code, _, err = run_cli(capsys, "status", "--redis-url", store.url, "--cluster", store.cluster,
                           "--placement-out", str(trt), "--format", "trtllm")
    assert code == 0, err
    keys = list(yaml.safe_load(trt.read_text())["initial_global_assignments"])
    assert keys == list(range(3, 61))  # model layer keys, not 0..57
    assert np.array_equal(read_placement(trt, num_logical_experts=E).for_layers(dump.layer_ids).phy2log, plan)

    # a rebalance of the cluster's placement: its export is the --old of the dump's model layers
    code, out, err = run_cli(capsys, "rebalance", "--load", dump.path, "--num-replicas", str(P), "--num-groups",
                             "8", "--num-nodes", "4", "--num-gpus", str(GPUS), "--old", str(exported))
    assert code == 0, err
    after = next(line for line in out.splitlines() if line.startswith("after (deepseek)"))
    assert after.split()[-1] == "0"  # deepseek is deterministic: nothing moves from its own plan


def test_http_placement_export_agrees(dsv3):
    from fdeplb.api import service

    store, plan = dsv3
    text, media = service.placement(store, "sglang")
    assert media == "application/json" and len(json.loads(text)["physical_to_logical_map"]) == 61
    body = service.placement(store, None)
    assert body["layer_ids"] == list(range(3, 61)) and np.array_equal(body["phy2log"], plan)


def test_init_cluster_stores_layer_ids_and_reads_an_sglang_initial_file(redis_url, cluster_id, capsys, tmp_path):
    pytest.importorskip("safetensors")
    from fdeplb.weights import write_synthetic_checkpoint

    ckpt = write_synthetic_checkpoint(tmp_path / "ckpt", 2, 4, hidden=4, intermediate=4)
    initial = tmp_path / "init.json"  # SGLang's layout: model layers 0 (dense), 1, 2 (MoE)
    initial.write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2, 3], [3, 2, 1, 0], [1, 0, 3, 2]]}))
    store = Store(redis_url, cluster_id)
    try:
        code, out, err = run_cli(capsys, "init-cluster", "--redis-url", redis_url, "--cluster", cluster_id,
                                 "--num-layers", "2", "--num-logical-experts", "4", "--num-redundant-experts", "0",
                                 "--ep-size", "2", "--checkpoint", str(ckpt), "--first-moe-layer", "1",
                                 "--initial", str(initial))
        assert code == 0, out + err
        cfg = store.read_config()
        assert (cfg.layer_ids, cfg.model_layers) == ([1, 2], 3)
        assert store.current_placement().phy2log.tolist() == [[3, 2, 1, 0], [1, 0, 3, 2]]
    finally:
        store.delete_cluster()
    code, _, err = run_cli(capsys, "init-cluster", "--redis-url", redis_url, "--cluster", cluster_id,
                           "--num-layers", "2", "--num-logical-experts", "4", "--num-redundant-experts", "0",
                           "--ep-size", "2", "--checkpoint", str(ckpt), "--layer-ids", "3,1")
    assert code == 2 and "ascending" in err
    for bad in ("60-3", "", "3,-1"):  # a descending range is empty, not "no layer ids"
        code, _, err = run_cli(capsys, "init-cluster", "--redis-url", redis_url, "--cluster", cluster_id,
                               "--num-layers", "2", "--num-logical-experts", "4", "--num-redundant-experts", "0",
                               "--ep-size", "2", "--checkpoint", str(ckpt), "--layer-ids", bad)
        assert code == 2 and "ascending" in err, (bad, err)
