"""Write the golden outputs of DeepSeek's ``eplb.py`` (torch CPU) that tests/placement/test_golden.py compares with.

This script contains no code of ``eplb.py``: it imports the module from the folder given on the command line and
stores only what ``eplb.rebalance_experts`` returns (phy2log, log2phy, logcnt) for every case. It needs a Python
with torch (CPU) and numpy, and fdeplb (plus its placement dependencies, numpy and scipy) on the path to read the
real dumps. torch is never a dependency of fdeplb: use a throwaway venv, e.g.::

    python3 -m venv /tmp/eplbref && /tmp/eplbref/bin/pip install torch==2.13.0 numpy scipy
    git --git-dir=<mirror of github.com/deepseek-ai/EPLB> show HEAD:eplb.py > /tmp/eplbsrc/eplb.py
    PYTHONPATH=. /tmp/eplbref/bin/python tests/placement/golden/make_deepseek_golden.py /tmp/eplbsrc \
        --real-data ../shared/real_data --out tests/placement/golden/deepseek_eplb.npz

Cases (all written to one compressed ``.npz``; its ``meta`` entry is a JSON list of the cases):

- ``real``: every dump of ``--real-data`` (16 files) at four topologies, ``E`` being the dump's expert count
  (256 for DeepSeek-V3, 128 for Qwen3, 64 for Qwen2-57B): ``(E+32 slots, 8 groups, 4 nodes, 32 GPUs)``,
  ``(E+32, 8, 1, 32)``, ``(E+32, 1 group, 2 nodes, 32 GPUs)`` (global policy) and ``(E+16, 8, 2, 16)``. For
  DeepSeek-V3 that is 288/8/4/32, 288/8/1/32, 288/1/2/32 and 272/8/2/16; 8 groups divide every model's experts.
  Only the outputs and the dump's path relative to the real-data folder are stored, not the loads.
- ``small``: the two small hand-made cases, loads stored.
- ``random``: ``--random`` cases from a fixed seed, loads stored: small integer loads (many ties), 1-3 layers,
  hierarchical and global topologies (global both with one group and with ``num_groups % num_nodes != 0``), most
  with more than 16 slots per node (rows longer than 16 in the GPU packing step, where torch's sort is not stable).

Arrays are stored with the smallest integer dtype that holds them; tests cast back to int64.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REAL_TOPOLOGIES = [  # (extra slots, num_groups, num_nodes, num_gpus)
    (32, 8, 4, 32),
    (32, 8, 1, 32),
    (32, 1, 2, 32),
    (16, 8, 2, 16),
]
SMALL_CASES = [  # (load, num_replicas, num_groups, num_nodes, num_gpus)
    ([[1, 7, 4, 1, 28, 10]], 64, 2, 4, 16),
    ([[8, 195, 1, 3, 1, 2, 1710, 2], [1, 8, 1, 3, 63, 33, 1, 1]], 24, 2, 4, 12),
]


def small_int(arr: np.ndarray) -> np.ndarray:
    """``arr`` (integer valued) in the smallest signed/unsigned integer dtype that holds it."""
    arr = np.asarray(arr)
    lo, hi = int(arr.min()), int(arr.max())
    for dt in (np.uint8, np.int8, np.int16, np.int32, np.int64):
        info = np.iinfo(dt)
        if info.min <= lo and hi <= info.max:
            return arr.astype(dt)
    raise ValueError("out of int64 range")


def random_case(rng: np.random.Generator) -> tuple[np.ndarray, int, int, int, int]:
    """One random valid case with many ties: (load int [L, E], num_replicas, num_groups, num_nodes, num_gpus)."""
    num_nodes = int(rng.choice([1, 2, 4]))
    num_gpus = num_nodes * int(rng.choice([1, 2, 3, 4, 8]))
    mode = rng.choice(["hierarchical", "hierarchical", "one_group", "mismatch"])
    if mode == "mismatch" and num_nodes == 1:
        mode = "one_group"
    if mode == "hierarchical":
        num_groups = num_nodes * int(rng.choice([1, 2, 4, 8]))
    elif mode == "one_group":
        num_groups = 1
    else:  # num_groups % num_nodes != 0: the global policy
        num_groups = int(rng.choice([g for g in (1, 2, 3, 5, 6, 7) if g % num_nodes]))
    group_size = int(rng.choice([1, 2, 3, 4, 6, 8, 16, 32]))
    while num_groups * group_size > 256:
        group_size //= 2
    E = num_groups * group_size
    P = -(-E // num_gpus) * num_gpus + num_gpus * int(rng.choice([0, 1, 1, 2, 3, 5, 8]))
    if P > 512:
        P = -(-E // num_gpus) * num_gpus
    L = int(rng.integers(1, 4))
    kind = rng.choice(["tiny", "small", "zeros", "spiky"])
    if kind == "tiny":
        load = rng.integers(0, int(rng.choice([2, 3, 4])), size=(L, E))
    elif kind == "small":
        load = rng.integers(0, int(rng.choice([8, 16, 64])), size=(L, E))
    elif kind == "zeros":
        load = np.zeros((L, E), dtype=np.int64)
        load[:, rng.integers(0, E)] = int(rng.integers(0, 5))
    else:  # a few hot experts on a flat background
        load = np.full((L, E), int(rng.integers(0, 3)), dtype=np.int64)
        hot = rng.integers(0, E, size=max(1, E // 8))
        load[:, hot] = rng.choice([4, 6, 8, 12], size=(L, len(hot)))
    return load.astype(np.int64), P, num_groups, num_nodes, num_gpus


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("eplb_dir", type=Path, help="folder holding DeepSeek's eplb.py")
    parser.add_argument("--real-data", type=Path, required=True, help="folder of the real dumps (../shared/real_data)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--random", type=int, default=300, help="number of random cases")
    parser.add_argument("--seed", type=int, default=9)
    args = parser.parse_args(argv)

    sys.path.insert(0, str(args.eplb_dir))
    import eplb  # noqa: E402  (DeepSeek's module, from the folder given)
    import torch  # noqa: E402

    from fdeplb.placement import read_expert_load  # noqa: E402

    torch.set_num_threads(1)
    arrays: dict[str, np.ndarray] = {}
    cases: list[dict] = []

    def run(kind: str, load: np.ndarray, P: int, G: int, N: int, gpus: int, **extra) -> None:
        phy2log, log2phy, logcnt = eplb.rebalance_experts(torch.tensor(load), P, G, N, gpus)
        i = len(cases)
        cases.append({"id": i, "kind": kind, "num_replicas": P, "num_groups": G, "num_nodes": N, "num_gpus": gpus,
                      **extra})
        arrays[f"{i}.phy2log"] = small_int(phy2log.numpy())
        arrays[f"{i}.log2phy"] = small_int(log2phy.numpy())
        arrays[f"{i}.logcnt"] = small_int(logcnt.numpy())
        if kind != "real":
            arrays[f"{i}.load"] = small_int(load)

    for path in sorted(args.real_data.glob("*/*.json")):
        load = np.asarray(read_expert_load(path).expert_load)
        E = load.shape[1]
        for extra_slots, G, N, gpus in REAL_TOPOLOGIES:
            run("real", load, E + extra_slots, G, N, gpus, dump=path.relative_to(args.real_data).as_posix())
    for load, P, G, N, gpus in SMALL_CASES:
        run("small", np.array(load, dtype=np.int64), P, G, N, gpus)
    rng = np.random.default_rng(args.seed)
    for _ in range(args.random):
        run("random", *random_case(rng))

    meta = {"eplb": "github.com/deepseek-ai/EPLB eplb.py", "torch": torch.__version__, "cases": cases}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "wb") as fh:
        np.savez_compressed(fh, meta=np.array(json.dumps(meta)), **arrays)
    kinds = {k: sum(c["kind"] == k for c in cases) for k in ("real", "small", "random")}
    print(f"wrote {len(cases)} cases {kinds} to {args.out} ({args.out.stat().st_size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
