"""A serving node with fdeplb embedded: 4 EP worker processes run a real tiny MoE model in paddle while rounds run.

Run with no arguments: ``python examples/serving_node.py``. It starts an embedded Redis, writes a small synthetic
safetensors checkpoint (2 MoE layers x 8 experts, 4 redundant slots), a coordinator thread, and one worker process
per EP rank. Every worker embeds an :class:`fdeplb.orchestration.embedded_agent.EmbeddedAgent` and, every step:

1. draws its batch of tokens (seeded per step and rank) and runs each MoE layer: gate -> top-k (the gate is biased
   by a real DeepSeek-V3 dump's expert distribution, ``../shared/real_data``; a Zipf one when it is absent) ->
   dispatch every (token, expert) through the live ``log2phy`` / ``logcnt`` to a physical slot and its owning
   rank -> an all-to-all through multiprocessing queues -> the owner's expert FFN on its **live slot tensors** ->
   the results back (a second all-to-all) -> combine;
2. compares the MoE output with a reference computed from the checkpoint's logical experts without EPLB
   (relative difference; a wrong expert or a stale map gives O(1));
3. calls ``agent.record(counts per physical slot)`` and ``agent.at_safe_point()``.

While it serves, the driver runs a rearrangement, a weight clear and update (FastDeploy's clear_load_weight /
update_model_weight, reloaded in the current placement), then a second rearrangement on a shifted distribution.
After each of these four changes it checks that every rank applied it at the change's switch step (the step the
armed ranks fixed together, see ``EmbeddedAgent.at_safe_point``). Swaps are chunked (``layers_per_safe_point=1``:
one MoE layer per safe point, chunk k at switch step + k on every rank), and every step's output still equals the
no-EPLB reference between chunks. The last line is JSON (``switches``: each change's switch step, chunks and the
step every rank applied its last chunk at; ``chunks_per_swap`` and ``max_pause_ms``: the rounds' most chunks and
longest safe-point pause; ``loadavg_1m``: the host's load at the start and the end); the exit status is 0 only when
every check held.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

L, E, P, EP, H, INTER, TOPK, TOKENS = 2, 8, 12, 4, 16, 8, 2, 24
SPR = P // EP
DUMP = Path(__file__).resolve().parents[2] / "shared" / "real_data" / "dsv3_sglang_ep_stats" / "decode_in1000out1000.json"
TOL = 1e-5


def expert_distribution() -> tuple[np.ndarray, str]:
    """float64 [L, E], rows sum to 1: a real dump's 256 experts folded into E groups (its first L layers)."""
    if DUMP.is_file():
        from fdeplb.placement.loads import read_expert_load

        load = np.asarray(read_expert_load(DUMP).expert_load, dtype=np.float64)[:L]
        folded = load.reshape(L, E, -1).sum(axis=2) + 1.0
        source = str(DUMP)
    else:
        folded = np.stack([1.0 / np.arange(1, E + 1) ** 1.2 for _ in range(L)])
        source = "zipf(1.2)"
    return folded / folded.sum(axis=1, keepdims=True), source


# ---- worker process -----------------------------------------------------------------------------------------------
def worker(rank: int, url: str, cluster: str, ckpt: str, dist: np.ndarray, qs, back, results, phase,
           stop_at) -> None:
    """One EP rank's serving loop (see the module doc). ``qs[src][dst]`` carries the dispatch all-to-all,
    ``back[src][dst]`` the replies."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    import paddle
    import paddle.nn.functional as F

    from fdeplb.orchestration.embedded_agent import EmbeddedAgent
    from fdeplb.weights.checkpoint import CheckpointReader

    paddle.set_device("cpu")
    agent = EmbeddedAgent(url, rank, cluster=cluster, block_ms=20, publish_interval_s=1.0).start()
    live = agent.backend.live
    up, down = "up_gate_proj.weight", "down_proj.weight"
    reader = CheckpointReader(ckpt, preset="ernie")
    ref = {(l, e): {k: paddle.to_tensor(v.numpy()) for k, v in reader.read_expert(l, e).items()}
           for l in range(L) for e in range(E)}
    gate = np.random.default_rng(1234).standard_normal((L, H, E)).astype(np.float32) * 0.3

    def ffn(x, w):
        h = paddle.matmul(x, w[up])
        g, u = paddle.split(h, 2, axis=-1)
        return paddle.matmul(F.silu(g) * u, w[down])

    def exchange(payloads, table):  # all-to-all: payloads[dst] out, what every src sent me in
        for dst in range(EP):
            table[rank][dst].put(payloads[dst])
        return [table[src][rank].get(timeout=120) for src in range(EP)]

    results.put(("ready", rank))
    step, max_diff = 0, 0.0
    try:
        while True:
            step += 1
            if stop_at.value and step >= stop_at.value:
                break
            serving = agent.serving
            dist_now = dist if phase.value == 0 else np.roll(dist, E // 2, axis=1)
            rng = np.random.default_rng([step, rank])
            x = rng.standard_normal((TOKENS, H)).astype(np.float32)
            counts = np.zeros((L, P), np.int64)
            diff = None
            log2phy, logcnt = live.log2phy.numpy(), live.logcnt.numpy()  # change only at safe points
            for layer in range(L):
                logits = x @ gate[layer] + 2.0 * np.log(dist_now[layer]).astype(np.float32)
                ids = np.argsort(-logits, axis=1, kind="stable")[:, :TOPK]
                w = np.take_along_axis(logits, ids, 1)
                w = np.exp(w - w.max(1, keepdims=True))
                w = (w / w.sum(1, keepdims=True)).astype(np.float32)
                out = np.zeros_like(x)
                payloads = [[] for _ in range(EP)]
                if serving:
                    for t in range(TOKENS):
                        for k in range(TOPK):
                            e = int(ids[t, k])
                            phy = int(log2phy[layer, e, (t + step) % int(logcnt[layer, e])])
                            counts[layer, phy] += 1
                            payloads[phy // SPR].append((t, k, phy % SPR))
                sent = [np.array(p, np.int64).reshape(-1, 3) for p in payloads]
                got = exchange([(s, x[s[:, 0]]) for s in sent], qs)
                replies = []
                for idx, xs in got:  # compute for my slots, on the live tensors
                    y = np.zeros_like(xs)
                    for slot in (np.unique(idx[:, 2]).tolist() if agent.serving else []):  # cleared: zeros
                        m = idx[:, 2] == slot
                        wts = {k: live.tensors[k][layer][slot] for k in (up, down)}
                        y[m] = ffn(paddle.to_tensor(xs[m]), wts).numpy()
                    replies.append(y)
                answers = exchange(replies, back)
                for s, y in zip(sent, answers):
                    for (t, k, _), row in zip(s.tolist(), y):
                        out[t] += w[t, k] * row
                if serving:
                    expect = np.zeros_like(x)
                    for e in np.unique(ids).tolist():  # the checkpoint's logical expert e, no EPLB
                        t, k = np.nonzero(ids == e)
                        expect[t] += w[t, k][:, None] * ffn(paddle.to_tensor(x[t]), ref[(layer, e)]).numpy()
                    d = float(np.abs(out - expect).max() / max(np.abs(expect).max(), 1e-12))
                    diff = d if diff is None else max(diff, d)
                    x = x + expect  # the next layer sees the correct output (a wrong one is caught at this layer)
            if serving:
                agent.record(counts)
                max_diff = max(max_diff, diff)
            agent.at_safe_point()
            results.put(("step", rank, step, time.time() * 1000, diff))
        results.put(("done", rank, list(agent.pauses_ms), agent.late_switches, max_diff))
    except Exception as err:  # noqa: BLE001 - reported to the driver, which fails the run
        results.put(("error", rank, f"{type(err).__name__}: {err}"))
    finally:
        agent.close()


# ---- driver -------------------------------------------------------------------------------------------------------
def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fdeplb.machines.tables import ClusterState, WeightState
    from fdeplb.orchestration.coordinator import Coordinator
    from fdeplb.orchestration.operations import init_cluster
    from fdeplb.placement import initial_placement
    from fdeplb.store import ClusterConfig, Deadlines, EmbeddedRedis, Store
    from fdeplb.weights import write_synthetic_checkpoint

    t_start = time.monotonic()
    load_start = round(os.getloadavg()[0], 2)  # the host's 1-minute load average, at the start and at the end
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # 4 worker processes on few cores: one compute thread each
    dist, source = expert_distribution()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis() as server:
        ckpt = write_synthetic_checkpoint(Path(tmp) / "ckpt", L, E, hidden=H, intermediate=INTER)
        cluster = "serving-node"
        store = Store(server.url, cluster)
        config = ClusterConfig(num_layers=L, num_logical_experts=E, num_physical_experts=P, ep_size=EP,
                               checkpoint={"path": str(ckpt), "preset": "ernie"}, layers_per_safe_point=1,
                               deadlines=Deadlines(collecting_ms=30_000, loading_ms=30_000, swapping_ms=30_000))
        init_cluster(store, config, initial_placement(L, E, P).phy2log)
        coordinator = Coordinator(Store(server.url, cluster), lease_ms=1_500)
        coordinator_thread = threading.Thread(target=coordinator.run, daemon=True)
        coordinator_thread.start()

        qs = [[ctx.Queue() for _ in range(EP)] for _ in range(EP)]  # qs[src][dst]
        back = [[ctx.Queue() for _ in range(EP)] for _ in range(EP)]
        results, phase, stop_at = ctx.Queue(), ctx.Value("i", 0), ctx.Value("i", 0)
        procs = []
        for r in range(EP):
            procs.append(ctx.Process(target=worker, args=(r, server.url, cluster, str(ckpt), dist, qs, back,
                                                                 results, phase, stop_at), daemon=True))
        for p in procs:
            p.start()

        state = {"steps": {}, "diffs": [], "errors": [], "done": [], "ready": 0}
        lock = threading.Condition()

        def drain() -> None:
            while len(state["done"]) + len(state["errors"]) < EP:
                try:
                    msg = results.get(timeout=1)
                except queue.Empty:
                    if not any(p.is_alive() for p in procs):
                        return
                    continue
                with lock:
                    if msg[0] == "ready":
                        state["ready"] += 1
                    elif msg[0] == "step":
                        _, r, step, ts, diff = msg
                        state["steps"].setdefault(r, []).append((step, ts))
                        if diff is not None:
                            state["diffs"].append(diff)
                    elif msg[0] == "done":
                        state["done"].append(msg)
                    else:
                        state["errors"].append(msg)
                    lock.notify_all()

        drainer = threading.Thread(target=drain, daemon=True)
        drainer.start()

        def steps_now() -> int:
            with lock:
                return min((s[-1][0] for s in state["steps"].values()), default=0) if len(state["steps"]) == EP else 0

        def wait(pred, what: str, timeout: float = 60.0) -> None:
            end = time.monotonic() + timeout
            while not pred():
                if state["errors"] or time.monotonic() > end:
                    raise RuntimeError(f"waiting for {what}: {state['errors'] or 'timed out'}")
                time.sleep(0.05)

        def round_done(n: int) -> bool:
            rec = store.read_cluster()
            return rec.state is ClusterState.FREE and rec.round >= n

        def weights_all(s) -> bool:
            return all(store.read_weights(r).state is s for r in range(EP))

        switches = []

        def switched_together(what: str, switch_step: int) -> None:
            """Every rank reports the step it applied the change at: it must be the switch step on every rank."""
            wait(lambda: all(store.read_rank(r).applied_step >= switch_step for r in range(EP)), f"{what} reports")
            ranks = [store.read_rank(r) for r in range(EP)]
            chunks = max(x.chunks for x in ranks) if what.startswith("round") else 1  # a swap: chunk k at step + k
            switches.append({"what": what, "switch_step": switch_step, "chunks": chunks,
                             "last_step": switch_step + chunks - 1, "applied_steps": [x.applied_step for x in ranks],
                             "max_pause_ms": max(x.pause_max_ms for x in ranks) if what.startswith("round") else 0.0})

        ok, failure = True, ""
        try:
            wait(lambda: steps_now() >= 20, "warm-up", 120)
            store.request_round("serving_node")
            wait(lambda: round_done(1), "round 1")
            switched_together("round 1", store.read_cluster().switch_step)
            store.request_weights("clear", "serving_node")
            wait(lambda: weights_all(WeightState.CLEARED), "clear")
            switched_together("clear", store.read_cluster().weights_switch_step)
            s = steps_now()
            wait(lambda: steps_now() >= s + 5, "steps while cleared")
            store.request_weights("update", "serving_node")
            wait(lambda: weights_all(WeightState.NORMAL), "update")
            switched_together("update", store.read_cluster().weights_switch_step)
            phase.value = 1
            store.request_clear_stat("serving_node")
            s = steps_now()
            wait(lambda: steps_now() >= s + 20, "phase 2 load")
            store.request_round("serving_node")
            wait(lambda: round_done(2), "round 2")
            switched_together("round 2", store.read_cluster().switch_step)
            s = steps_now()
            wait(lambda: steps_now() >= s + 10, "steps after round 2")
        except RuntimeError as err:
            ok, failure = False, str(err)
        stop_at.value = steps_now() + 5
        for p in procs:
            p.join(60)
        drainer.join(10)
        coordinator.stop_event.set()
        coordinator_thread.join(10)  # before the embedded Redis stops: the JSON line stays the last one

        audit = list(store.iter_audit())
        spans, start = [], None
        for a in audit:
            if a["machine"] == "cluster" and a["trigger"] == "start":
                start = int(a["ts_ms"])
            elif a["machine"] == "cluster" and a["trigger"] in ("release", "abort") and start is not None:
                spans.append((start, int(a["ts_ms"])))
                start = None
        rounds = sum(1 for a in audit if a["machine"] == "cluster" and a["trigger"] == "release")
        rank0 = state["steps"].get(0, [])
        during = sum(1 for _, ts in rank0 if any(a <= ts <= b for a, b in spans))
        pauses = [x for d in state["done"] for x in d[2]]
        late = sum(d[3] for d in state["done"])
        count = lambda trig: sum(1 for a in audit if a["machine"] == "weights" and a["trigger"] == trig) // EP
        summary = {
            "rounds": rounds, "steps": len(rank0), "steps_during_rounds": during,
            "max_rel_diff": max(state["diffs"], default=float("nan")),
            "weight_updates": count("updated"), "weight_clears": count("cleared"),
            "safe_point_pause_ms": {"p50": round(float(np.median(pauses)), 3) if pauses else None,
                                    "max": round(float(np.max(pauses)), 3) if pauses else None,
                                    "applied": len(pauses)},
            "late_switches": late, "switches": switches, "errors": [e[2] for e in state["errors"]],
            "chunks_per_swap": max((s["chunks"] for s in switches if s["what"].startswith("round")), default=0),
            "max_pause_ms": round(max((s["max_pause_ms"] for s in switches if s["what"].startswith("round")),
                                      default=0.0), 3),
            "load_source": source, "loadavg_1m": [load_start, round(os.getloadavg()[0], 2)],
            "wall_s": round(time.monotonic() - t_start, 1),
        }
        together = len(switches) == 4 and all(s["switch_step"] > 0 and s["applied_steps"] == [s["last_step"]] * EP
                                              for s in switches)
        ok = ok and not summary["errors"] and rounds >= 2 and during > 0 and summary["max_rel_diff"] <= TOL \
            and summary["weight_updates"] >= 1 and summary["weight_clears"] >= 1 and late == 0 and together
        if failure:
            summary["failure"] = failure
        summary["ok"] = ok
        print(f"rounds {rounds}, steps {len(rank0)} ({during} during rounds), max_rel_diff "
              f"{summary['max_rel_diff']:.2e}, clears {summary['weight_clears']}, updates {summary['weight_updates']},"
              f" safe-point pause p50 {summary['safe_point_pause_ms']['p50']} ms max "
              f"{summary['safe_point_pause_ms']['max']} ms, {summary['wall_s']} s")
        print(json.dumps(summary))
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
