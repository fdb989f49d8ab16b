"""What the sim tests share (and the takeover and member-repair tests): a worker process (:func:`worker_process`),
a load trace file (:func:`write_trace`), a two-rank cluster (:func:`two_rank_cluster`) and the one-line error check
of a worker that exits (:func:`one_line_error`)."""

from __future__ import annotations

import subprocess
import sys


def worker_process(redis_url, cluster, *args, env=None, backend="numpy", trace=None):
    cmd = [sys.executable, "-m", "fdeplb.sim.worker", "--redis-url", redis_url, "--cluster", cluster,
           "--backend", backend, "--redis-wait-s", "0.2", "--log-level", "WARNING", *args]
    if trace is not None:
        cmd += ["--trace", str(trace)]
    import os

    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})



def write_trace(tmp_path, layers, experts):
    import json

    path = tmp_path / f"trace_{layers}x{experts}.json"
    path.write_text(json.dumps({"counts": [[1 + (i + j) % 5 for j in range(experts)] for i in range(layers)]}))
    return path



def two_rank_cluster(redis_url, cluster_id):
    from fdeplb.orchestration import init_cluster
    from fdeplb.placement import initial_placement
    from fdeplb.store import ClusterConfig, Store

    store = Store(redis_url, cluster_id)
    init_cluster(store, ClusterConfig(num_layers=2, num_logical_experts=8, num_physical_experts=12, ep_size=2),
                 initial_placement(2, 8, 12).phy2log)
    return store



def one_line_error(proc, code):
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, (proc.returncode, out, err)
    errors = [ln for ln in err.splitlines() if not ln.startswith("{")]  # besides JSON log lines: one line
    assert len(errors) == 1 and errors[0].startswith("error: ") and "Traceback" not in err, err
    return errors[0]
