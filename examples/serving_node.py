"""A serving node with fdeplb embedded: 4 EP worker processes run a real tiny MoE model in paddle while rounds run.

Run with no arguments: ``python examples/serving_node.py``. It starts an embedded Redis, writes a small synthetic
safetensors checkpoint (2 MoE layers x 8 experts, 4 redundant slots), a coordinator thread, and one worker process
per EP rank. Every worker embeds an :class:`fdeplb.orchestration.embedded_agent.EmbeddedAgent` and, every step:

1. draws its batch of tokens (seeded per step and rank) and runs each MoE layer: gate -> top-k (the gate is biased
   by a real DeepSeek-V3 dump's expert distribution, ``$FDEPLB_REAL_DATA`` or ``../shared/real_data``; a Zipf one
   when it is absent) ->
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
step every rank applied its last chunk at, and for a swap its longest safe-point pause; ``chunks_per_swap`` and
``max_pause_ms``: the rounds' most chunks and longest swap pause; ``safe_point_pause_ms``: every safe point that
applied something, weight clears and updates included; ``loadavg_1m``: the host's load at the start and the end);
``peer_bytes`` / ``disk_bytes``: what the rounds' staging took from peers' live slots / read from the checkpoint
(the workers share a peer secret); the exit status is 0 only when every check held, moved experts taken from peers
included.

``--lose-rank R`` runs the elastic scenario instead (README "Membership: losing a rank"): after the warm-up rank R's
worker is SIGKILLed and not restarted. The survivors keep serving: their dispatcher sends to the members the
placement is routed over (``agent.live_ranks``) and treats a member whose process is gone as down (as NCCL or
DeepEP report a dead peer), so the tokens routed to it are lost until the switch. The coordinator suspects, then
excludes the rank and re-places its orphaned experts on redundant slots of the survivors; from that round's
switch step every step's output must equal the reference again and no token may be routed to a non-member. Then
a new worker for rank R starts (it follows the engine's step counter, as a rank joining a running engine does),
rejoins (EXCLUDED -> REJOINING -> ACTIVE), and serves from the switch step of the membership round that follows.
The last line is JSON with ``lost_rank``, ``excluded_after_s``, ``replaced_experts``, ``steps_after_loss``,
``max_rel_diff_after_switch`` and ``rejoined``.
"""

from __future__ import annotations

import argparse
import secrets
import json
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

L, E, P, EP, H, INTER, TOPK, TOKENS = 2, 8, 12, 4, 16, 8, 2, 24
SPR = P // EP
REAL_DATA = Path(os.environ.get("FDEPLB_REAL_DATA", Path(__file__).resolve().parents[2] / "shared" / "real_data"))
DUMP = REAL_DATA / "dsv3_sglang_ep_stats" / "decode_in1000out1000.json"
TOL = 1e-5
#: --lose-rank: rank r holds experts 2r and 2r+1 and a copy of expert 2(r+1) mod 8, so expert 2r+1 lives on rank r
#: only: whichever rank is lost orphans one expert per layer, which the re-placement moves onto a redundant slot
ELASTIC_PHY2LOG = [[0, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7, 0]] * L
PEER_POLL_S, PEER_DEADLINE_S = 0.25, 120.0


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
class DataPlane:
    """One worker's side of the EP group's all-to-all (what NCCL / DeepEP are in an engine), over multiprocessing
    queues: ``chans[inc][src][dst]``, one set per incarnation of a rank (a rejoining worker talks on fresh queues:
    a killed process may leave half a message in its old ones). The group is the members the placement is routed
    over (``agent.live_ranks``, read at the start of every step); a member whose process is gone is *down* (a dead
    peer, as the collective library reports it) and skipped until it is a member again after having left."""

    def __init__(self, rank: int, incarnation: int, pids) -> None:
        self.rank, self.incarnation, self.pids = rank, incarnation, pids
        self.inc = [0] * EP  # the incarnation each peer talks on
        self.down: set[int] = set()
        self.members: tuple[int, ...] = tuple(range(EP))

    def step(self, live_ranks: tuple[int, ...]) -> None:
        """The members for this step: a rank that comes back after having left talks on its next incarnation."""
        for r in live_ranks:
            if r != self.rank and r not in self.members:
                self.inc[r] = max(self.inc[r] + 1, self.incarnation)
                self.down.discard(r)
        self.members = tuple(live_ranks)

    def peers(self) -> list[int]:
        return [r for r in self.members if r not in self.down]

    def _chan(self, chans, src: int, dst: int):
        other = dst if src == self.rank else src
        return chans[max(self.incarnation, self.inc[other])][src][dst]

    def _alive(self, r: int) -> bool:
        try:
            os.kill(int(self.pids[r]), 0)
        except ProcessLookupError:
            return False
        return True

    def exchange(self, payloads: dict, chans) -> dict:
        """Send ``payloads[dst]`` to every peer, receive what every peer sent: ``{src: payload}`` (a peer found
        dead meanwhile is marked down and left out)."""
        peers = self.peers()
        for dst in peers:
            self._chan(chans, self.rank, dst).put(payloads[dst])
        got, end = {}, time.monotonic() + PEER_DEADLINE_S
        for src in peers:
            q = self._chan(chans, src, self.rank)
            while True:
                try:
                    got[src] = q.get(timeout=PEER_POLL_S)
                    break
                except queue.Empty:
                    if src != self.rank and not self._alive(src):
                        self.down.add(src)
                        break
                    if time.monotonic() > end:
                        raise RuntimeError(f"rank {self.rank}: no message from rank {src} in {PEER_DEADLINE_S} s")
        return got


def worker(rank: int, url: str, cluster: str, ckpt: str, dist: np.ndarray, chans, backs, results, phase,
           stop_at, pids, steps_of, heartbeat_ttl_ms: int, incarnation: int = 0, with_probe: bool = False) -> None:
    """One EP rank's serving loop (see the module doc). ``chans`` carries the dispatch all-to-all, ``backs`` the
    replies (see :class:`DataPlane`); ``steps_of[r]`` is rank r's step, which a rejoining worker
    (``incarnation`` 1) follows until it is routed to. ``with_probe``: register the output probe (its all-to-all
    needs every member at the same safe points: not in the elastic scenario, where a rejoining worker steps
    alone until it is routed to)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    import paddle
    import paddle.nn.functional as F

    from fdeplb.orchestration.embedded_agent import EmbeddedAgent
    from fdeplb.weights.checkpoint import CheckpointReader

    pids[rank] = os.getpid()
    for table in (chans, backs):  # never wait at exit for a queue nobody reads any more (a lost peer's)
        for q in (q for inc in table for row in inc for q in row):
            q.cancel_join_thread()
    paddle.set_device("cpu")
    agent = EmbeddedAgent(url, rank, cluster=cluster, block_ms=20, publish_interval_s=1.0,
                          heartbeat_ttl_ms=heartbeat_ttl_ms)
    if incarnation:  # joining a running engine: count steps from the engine's step (switch steps are fixed on it)
        agent.steps = max(int(steps_of[r]) for r in range(EP) if r != rank)
    agent.start()
    live = agent.backend.live
    up, down = "up_gate_proj.weight", "down_proj.weight"
    reader = CheckpointReader(ckpt, preset="ernie")
    ref = {(l, e): {k: paddle.to_tensor(v.numpy()) for k, v in reader.read_expert(l, e).items()}
           for l in range(L) for e in range(E)}
    gate = np.random.default_rng(1234).standard_normal((L, H, E)).astype(np.float32) * 0.3
    plane = DataPlane(rank, incarnation, pids)

    def ffn(x, w):
        """The expert's FFN on tokens ``x`` [n, H], one token at a time: a batched matmul may round a row
        differently with the batch around it, and a swap changes which tokens share a slot's batch."""
        rows = []
        for i in range(x.shape[0]):
            h = paddle.matmul(x[i:i + 1], w[up])
            g, u = paddle.split(h, 2, axis=-1)
            rows.append(paddle.matmul(F.silu(g) * u, w[down]))
        return paddle.concat(rows) if rows else paddle.zeros([0, H], dtype="float32")

    def route(layer, x, dist_now):
        """The gate: top-k experts of every token and their weights."""
        logits = x @ gate[layer] + 2.0 * np.log(dist_now[layer]).astype(np.float32)
        ids = np.argsort(-logits, axis=1, kind="stable")[:, :TOPK]
        w = np.take_along_axis(logits, ids, 1)
        w = np.exp(w - w.max(1, keepdims=True))
        return ids, (w / w.sum(1, keepdims=True)).astype(np.float32)

    def moe(layer, x, ids, w, log2phy, logcnt, shift, counts=None):
        """One MoE layer over the EP group: every (token t, expert) to replica (t + shift) mod logcnt through the
        live tables, the all-to-all, the owners' FFNs on their live slots, the answers back, combined. With
        ``counts`` (serving) the routed tokens are counted per slot. Returns (out, tokens lost, misrouted)."""
        out = np.zeros_like(x)
        payloads = {r: [] for r in range(EP)}
        peers = set(plane.peers())
        lost = misrouted = 0
        if counts is not None:
            for t in range(len(x)):
                for k in range(ids.shape[1]):
                    e = int(ids[t, k])
                    phy = int(log2phy[layer, e, (t + shift) % int(logcnt[layer, e])])
                    owner = phy // SPR
                    misrouted += owner not in plane.members  # the tables name a non-member's slot
                    if owner not in peers:  # a member found dead: the token's expert is lost
                        lost += 1
                        continue
                    counts[layer, phy] += 1
                    payloads[owner].append((t, k, phy % SPR))
        sent = {r: np.array(p, np.int64).reshape(-1, 3) for r, p in payloads.items()}
        got = plane.exchange({r: (s, x[s[:, 0]]) for r, s in sent.items()}, chans)
        replies = {}
        for src, (idx, xs) in got.items():  # compute for my slots, on the live tensors
            y = np.zeros_like(xs)
            for slot in (np.unique(idx[:, 2]).tolist() if agent.serving else []):  # cleared: zeros
                m = idx[:, 2] == slot
                wts = {k: live.tensors[k][layer][slot] for k in (up, down)}
                y[m] = ffn(paddle.to_tensor(xs[m]), wts).numpy()
            replies[src] = y
        answers = plane.exchange({r: replies.get(r, np.zeros((0, H), np.float32)) for r in range(EP)}, backs)
        lost += sum(len(sent[r]) for r in sent if r not in answers)  # a peer that died in this step
        parts = np.zeros((len(x), w.shape[1], x.shape[1]), np.float32)  # (token, k): summed in k order below
        for src, y in answers.items():
            for (t, k, _), row in zip(sent[src].tolist(), y):
                parts[t, k] = w[t, k] * row
        for k in range(w.shape[1]):  # the same order whichever slots served the token: bit-exact across swaps
            out += parts[:, k]
        return out, lost, misrouted

    probe_x = np.random.default_rng([99, rank]).standard_normal((L, TOKENS, H)).astype(np.float32)

    def probe():
        """The output probe (README "A swap checked by its output"): a fixed batch through every MoE layer, each
        layer fed its own fixed input (a wrong layer shows in its own output only), routed and computed like a
        step, on the tables and slots live now. Every rank runs it at the same safe points (the first and the last
        chunk's switch steps), so its all-to-all pairs with theirs as a step's does."""
        log2phy, logcnt = live.log2phy.numpy(), live.logcnt.numpy()
        outputs = {}
        for layer in range(L):
            ids, w = route(layer, probe_x[layer], dist)
            outputs[layer] = moe(layer, probe_x[layer], ids, w, log2phy, logcnt, 0, np.zeros((L, P), np.int64))[0]
        return outputs

    if with_probe:  # bit-exact (the default): one token's FFN and its k-ordered sum do not depend on the slot
        agent.set_probe(probe)
    # a rejoining worker is not routed to until the membership round's switch step: it follows the others' steps
    while rank not in agent.live_ranks and not stop_at.value:
        others = max(int(steps_of[r]) for r in range(EP) if r != rank)
        while agent.steps < others - 1:
            agent.at_safe_point()
        time.sleep(0.002)
    results.put(("ready", rank))
    step, max_diff = agent.steps, 0.0
    try:
        while True:
            step += 1
            steps_of[rank] = step
            if stop_at.value and step >= stop_at.value:
                break
            serving = agent.serving
            plane.step(agent.live_ranks)  # the members, switched together with the routing tables
            dist_now = dist if phase.value == 0 else np.roll(dist, E // 2, axis=1)
            rng = np.random.default_rng([step, rank])
            x = rng.standard_normal((TOKENS, H)).astype(np.float32)
            counts = np.zeros((L, P), np.int64)
            diff, lost, misrouted = None, 0, 0
            log2phy, logcnt = live.log2phy.numpy(), live.logcnt.numpy()  # change only at safe points
            for layer in range(L):
                ids, w = route(layer, x, dist_now)
                out, lost_here, misrouted_here = moe(layer, x, ids, w, log2phy, logcnt, step, counts if serving
                                                     else None)
                lost, misrouted = lost + lost_here, misrouted + misrouted_here
                if serving:
                    parts = np.zeros((len(x), ids.shape[1], H), np.float32)
                    for e in np.unique(ids).tolist():  # the checkpoint's logical expert e, no EPLB
                        t, k = np.nonzero(ids == e)
                        parts[t, k] = w[t, k][:, None] * ffn(paddle.to_tensor(x[t]), ref[(layer, e)]).numpy()
                    expect = np.zeros_like(x)
                    for k in range(ids.shape[1]):  # summed in k order, as moe() does
                        expect += parts[:, k]
                    d = float(np.abs(out - expect).max() / max(np.abs(expect).max(), 1e-12))
                    diff = d if diff is None else max(diff, d)
                    x = x + expect  # the next layer sees the correct output (a wrong one is caught at this layer)
            if serving:
                agent.record(counts)
                if not lost:
                    max_diff = max(max_diff, diff)
            agent.at_safe_point()
            results.put(("step", rank, step, time.time() * 1000, diff, lost, misrouted))
        results.put(("done", rank, list(agent.pauses_ms), agent.late_switches, max_diff))
    except Exception as err:  # noqa: BLE001 - reported to the driver, which fails the run
        results.put(("error", rank, f"{type(err).__name__}: {err}"))
    finally:
        agent.close()


# ---- driver -------------------------------------------------------------------------------------------------------
class Node:
    """The driver's side of the serving node: an embedded Redis, the checkpoint, the cluster, a coordinator thread,
    the worker processes and what they report (one results queue per worker: a killed process can corrupt only its
    own). ``phy2log``: the initial placement; ``deadlines``: the cluster's."""

    def __init__(self, tmp: str, url: str, phy2log, deadlines, dist: np.ndarray, heartbeat_ttl_ms: int,
                 with_probe: bool = False) -> None:
        from fdeplb.orchestration.coordinator import Coordinator
        from fdeplb.orchestration.cluster_setup import init_cluster
        from fdeplb.store import ClusterConfig, Store
        from fdeplb.weights import write_synthetic_checkpoint

        self.ctx = mp.get_context("spawn")
        self.url, self.cluster, self.dist, self.heartbeat_ttl_ms = url, "serving-node", dist, heartbeat_ttl_ms
        self.with_probe = with_probe
        self.ckpt = write_synthetic_checkpoint(Path(tmp) / "ckpt", L, E, hidden=H, intermediate=INTER)
        self.store = Store(url, self.cluster)
        config = ClusterConfig(num_layers=L, num_logical_experts=E, num_physical_experts=P, ep_size=EP,
                               checkpoint={"path": str(self.ckpt), "preset": "ernie"}, layers_per_safe_point=1,
                               deadlines=deadlines)
        init_cluster(self.store, config, np.asarray(phy2log, dtype=np.int64))
        self.coordinator = Coordinator(Store(url, self.cluster), lease_ms=1_500)
        self.coordinator_thread = threading.Thread(target=self.coordinator.run, daemon=True)
        self.coordinator_thread.start()
        ctx = self.ctx
        # [incarnation][src][dst]: a rejoining worker talks on the second set
        self.chans = [[[ctx.Queue() for _ in range(EP)] for _ in range(EP)] for _ in range(2)]
        self.backs = [[[ctx.Queue() for _ in range(EP)] for _ in range(EP)] for _ in range(2)]
        self.phase, self.stop_at = ctx.RawValue("i", 0), ctx.RawValue("i", 0)  # lock-free: a killed worker holds none
        self.pids, self.steps_of = ctx.RawArray("i", EP), ctx.RawArray("q", EP)
        self.procs: dict[tuple[int, int], mp.Process] = {}
        self.results: dict[tuple[int, int], mp.Queue] = {}
        self.state = {"steps": {}, "diffs": [], "errors": [], "done": [], "ready": 0}
        self.lock = threading.Condition()
        self._stop = threading.Event()
        self.drainer = threading.Thread(target=self._drain, daemon=True)

    def start_worker(self, rank: int, incarnation: int = 0) -> None:
        q = self.results[(rank, incarnation)] = self.ctx.Queue()
        p = self.procs[(rank, incarnation)] = self.ctx.Process(
            target=worker, args=(rank, self.url, self.cluster, str(self.ckpt), self.dist, self.chans, self.backs, q,
                                 self.phase, self.stop_at, self.pids, self.steps_of, self.heartbeat_ttl_ms, incarnation,
                                 self.with_probe),
            daemon=True)
        p.start()
        if not self.drainer.is_alive():
            self.drainer.start()

    def kill(self, rank: int) -> float:
        """SIGKILL rank's worker (not restarted) and reap it; returns the wall time in ms."""
        p = self.procs[(rank, 0)]
        os.kill(p.pid, signal.SIGKILL)
        at = time.time() * 1000
        p.join(10)
        return at

    def _drain(self) -> None:
        while not self._stop.is_set():
            idle = True
            for key, q in list(self.results.items()):
                if not self.procs[key].is_alive() and q.empty():
                    continue
                try:
                    msg = q.get_nowait()
                except queue.Empty:
                    continue
                except (EOFError, OSError):  # a killed worker's queue
                    continue
                idle = False
                with self.lock:
                    if msg[0] == "ready":
                        self.state["ready"] += 1
                    elif msg[0] == "step":
                        _, r, step, ts, diff, lost, misrouted = msg
                        self.state["steps"].setdefault(r, []).append((step, ts, diff, lost, misrouted))
                        if diff is not None:
                            self.state["diffs"].append(diff)
                    elif msg[0] == "done":
                        self.state["done"].append(msg)
                    else:
                        self.state["errors"].append(msg)
                    self.lock.notify_all()
            if idle:
                time.sleep(0.01)

    def steps_now(self, ranks=None) -> int:
        """The lowest last step of ``ranks`` (default: every rank), 0 until each reported one."""
        ranks = range(EP) if ranks is None else ranks
        with self.lock:
            steps = self.state["steps"]
            return min(steps[r][-1][0] for r in ranks) if all(r in steps for r in ranks) else 0

    def wait(self, pred, what: str, timeout: float = 60.0):
        end = time.monotonic() + timeout
        while True:
            got = pred()
            if got:
                return got
            if self.state["errors"] or time.monotonic() > end:
                raise RuntimeError(f"waiting for {what}: {self.state['errors'] or 'timed out'}")
            time.sleep(0.05)

    def round_done(self, n: int):
        from fdeplb.machines.tables import ClusterState

        rec = self.store.read_cluster()
        return rec.state is ClusterState.FREE and rec.round >= n and rec

    def finish(self, ranks) -> None:
        """Stop the workers 5 steps on, then the coordinator (before the embedded Redis stops)."""
        self.stop_at.value = self.steps_now(ranks) + 5
        for p in self.procs.values():
            p.join(60)
        self._stop.set()
        self.drainer.join(10)
        self.coordinator.stop_event.set()
        self.coordinator_thread.join(10)


def changes(node: Node) -> tuple[dict, bool]:
    """The default scenario (see the module doc): a rearrangement, a weight clear and update, a second
    rearrangement on a shifted distribution; every change applied at its switch step on every rank."""
    from fdeplb.machines.tables import WeightState

    store, state = node.store, node.state

    def weights_all(s) -> bool:
        return all(store.read_weights(r).state is s for r in range(EP))

    switches = []

    def switched_together(what: str, switch_step: int) -> None:
        """Every rank reports the step it applied the change at: it must be the switch step on every rank."""
        node.wait(lambda: all(store.read_rank(r).applied_step >= switch_step for r in range(EP)), f"{what} reports")
        ranks = [store.read_rank(r) for r in range(EP)]
        chunks = max(x.chunks for x in ranks) if what.startswith("round") else 1  # a swap: chunk k at step + k
        switches.append({"what": what, "switch_step": switch_step, "chunks": chunks,
                         "last_step": switch_step + chunks - 1, "applied_steps": [x.applied_step for x in ranks],
                         # the rank record times a swap's safe points; a weight clear or update is one safe
                         # point, timed with every other in safe_point_pause_ms (None here, not a 0 it never was)
                         "max_pause_ms": max(x.pause_max_ms for x in ranks) if what.startswith("round") else None,
                         # a swap's staging: bytes taken from peers' live slots and read from the checkpoint
                         "peer_bytes": sum(x.peer_bytes for x in ranks) if what.startswith("round") else 0,
                         "disk_bytes": sum(x.disk_bytes for x in ranks) if what.startswith("round") else 0,
                         # a swap's output probe on every rank (before the switch, after the last chunk)
                         **({"probe": [x.probe for x in ranks], "probe_ms": max(x.probe_before_ms + x.probe_after_ms
                                                                               for x in ranks)}
                            if what.startswith("round") else {})})

    for r in range(EP):
        node.start_worker(r)
    ok, failure = True, ""
    try:
        node.wait(lambda: node.steps_now() >= 20, "warm-up", 120)
        store.request_round("serving_node")
        node.wait(lambda: node.round_done(1), "round 1")
        switched_together("round 1", store.read_cluster().switch_step)
        store.request_weights("clear", "serving_node")
        node.wait(lambda: weights_all(WeightState.CLEARED), "clear")
        switched_together("clear", store.read_cluster().weights_switch_step)
        s = node.steps_now()
        node.wait(lambda: node.steps_now() >= s + 5, "steps while cleared")
        store.request_weights("update", "serving_node")
        node.wait(lambda: weights_all(WeightState.NORMAL), "update")
        switched_together("update", store.read_cluster().weights_switch_step)
        node.phase.value = 1
        store.request_clear_stat("serving_node")
        s = node.steps_now()
        node.wait(lambda: node.steps_now() >= s + 20, "phase 2 load")
        store.request_round("serving_node")
        node.wait(lambda: node.round_done(2), "round 2")
        switched_together("round 2", store.read_cluster().switch_step)
        s = node.steps_now()
        node.wait(lambda: node.steps_now() >= s + 10, "steps after round 2")
    except RuntimeError as err:
        ok, failure = False, str(err)
    node.finish(range(EP))

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
    during = sum(1 for _, ts, *_ in rank0 if any(a <= ts <= b for a, b in spans))
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
        "max_pause_ms": round(max((s["max_pause_ms"] for s in switches if s["max_pause_ms"] is not None),
                                  default=0.0), 3),
        "peer_bytes": sum(s["peer_bytes"] for s in switches), "disk_bytes": sum(s["disk_bytes"] for s in switches),
    }
    together = len(switches) == 4 and all(s["switch_step"] > 0 and s["applied_steps"] == [s["last_step"]] * EP
                                          for s in switches)
    summary["probe_agrees"] = all(s["probe"] == ["agree"] * EP for s in switches if "probe" in s) and \
        not any(a["trigger"] == "swapped" and a["reason"] for a in audit)
    ok = ok and not summary["errors"] and rounds >= 2 and during > 0 and summary["max_rel_diff"] <= TOL \
        and summary["weight_updates"] >= 1 and summary["weight_clears"] >= 1 and late == 0 and together \
        and summary["probe_agrees"] and summary["peer_bytes"] > 0
    if failure:
        summary["failure"] = failure
    print(f"rounds {rounds}, steps {len(rank0)} ({during} during rounds), max_rel_diff "
          f"{summary['max_rel_diff']:.2e}, clears {summary['weight_clears']}, updates {summary['weight_updates']},"
          f" safe-point pause p50 {summary['safe_point_pause_ms']['p50']} ms max "
          f"{summary['safe_point_pause_ms']['max']} ms")
    return summary, ok


def lose_rank(node: Node, lost: int) -> tuple[dict, bool]:
    """The elastic scenario (``--lose-rank``, see the module doc)."""
    from fdeplb.machines.tables import MEMBERSHIP, MemberState
    from fdeplb.rounds import reasons

    store, state = node.store, node.state
    survivors = [r for r in range(EP) if r != lost]
    for r in range(EP):
        node.start_worker(r)
    ok, failure, out = True, "", {}
    try:
        node.wait(lambda: node.steps_now() >= 20, "warm-up", 120)
        killed_ms = node.kill(lost)
        out["killed_at_step"] = node.steps_now(survivors)
        node.wait(lambda: store.read(MEMBERSHIP, lost).state is MemberState.EXCLUDED, f"rank {lost} excluded", 60)
        exclude = [a for a in store.iter_audit() if a["key"] == f"member:{lost}" and a["trigger"] == "exclude"][-1]
        out["excluded_after_s"] = round((int(exclude["ts_ms"]) - killed_ms) / 1000, 2)
        rec = node.wait(lambda: node.round_done(1) and store.current_placement().members != "" and
                        node.round_done(1), "the re-placement round", 90)
        load = [a for a in store.iter_audit() if a["key"] == "cluster" and a["trigger"] == "load"][-1]
        out["replaced_experts"] = len(((reasons.detail_of(load) or {}).get("replacement") or {}).get("orphans", []))
        out["switch_step"] = rec.switch_step
        node.wait(lambda: node.steps_now(survivors) >= rec.switch_step + 20, "steps after the switch", 60)
        # a new worker for the lost rank: rejoins, is admitted, and is routed to from the membership round's switch
        node.start_worker(lost, incarnation=1)
        node.wait(lambda: store.read(MEMBERSHIP, lost).state is MemberState.ACTIVE, f"rank {lost} admitted", 120)
        rec2 = node.wait(lambda: (r := node.round_done(rec.round + 1)) and store.current_placement().members == ""
                         and r, "the membership round", 90)
        out["rejoin_switch_step"] = rec2.switch_step
        node.wait(lambda: node.steps_now() >= rec2.switch_step + 10, "the rejoined rank serving", 60)
    except RuntimeError as err:
        ok, failure = False, str(err)
    node.finish(range(EP))

    steps = state["steps"]
    switch = out.get("switch_step", 0)
    after = [(r, s) for r, rows in steps.items() for s in rows if switch and s[0] > switch]
    before = [s for r, rows in steps.items() for s in rows if s[0] < out.get("killed_at_step", 0) - 1]
    rejoined_rows = [s for s in steps.get(lost, []) if out.get("rejoin_switch_step") and
                     s[0] > out["rejoin_switch_step"]]
    diffs_after = [s[2] for _, s in after if s[2] is not None]
    summary = {
        "lost_rank": lost,
        "excluded_after_s": out.get("excluded_after_s"),
        "replaced_experts": out.get("replaced_experts"),
        "steps_after_loss": sum(1 for s in steps.get(survivors[0], []) if s[0] > out.get("killed_at_step", 1 << 60)),
        "max_rel_diff_after_switch": max(diffs_after, default=float("nan")),
        "rejoined": bool(rejoined_rows) and all(s[2] is not None and s[2] <= TOL for s in rejoined_rows),
        "max_rel_diff_before_loss": max((s[2] for s in before if s[2] is not None), default=float("nan")),
        "tokens_lost_before_switch": sum(s[3] for rows in steps.values() for s in rows if s[0] <= switch),
        "tokens_lost_after_switch": sum(s[3] for _, s in after),
        "tokens_routed_to_non_members": sum(s[4] for rows in steps.values() for s in rows),
        "switch_step": switch, "rejoin_switch_step": out.get("rejoin_switch_step"),
        "rejoined_steps": len(rejoined_rows),
        "late_switches": sum(d[3] for d in state["done"]),
        "errors": [e[2] for e in state["errors"]],
    }
    ok = (ok and not summary["errors"] and summary["max_rel_diff_after_switch"] <= TOL
          and summary["max_rel_diff_before_loss"] <= TOL and summary["rejoined"]
          and summary["tokens_lost_after_switch"] == 0 and summary["tokens_routed_to_non_members"] == 0
          and summary["late_switches"] == 0 and (summary["replaced_experts"] or 0) > 0)
    if failure:
        summary["failure"] = failure
    print(f"rank {lost} lost at step {out.get('killed_at_step')}, excluded after {summary['excluded_after_s']} s, "
          f"{summary['replaced_experts']} experts re-placed (switch step {switch}), "
          f"{summary['tokens_lost_before_switch']} tokens lost before it, max_rel_diff after it "
          f"{summary['max_rel_diff_after_switch']:.2e}; rejoined: {summary['rejoined']} "
          f"({summary['rejoined_steps']} steps from step {summary['rejoin_switch_step']})")
    return summary, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lose-rank", type=int, default=None, metavar="R",
                        help=f"SIGKILL rank R's worker mid-serving, re-place its experts, then rejoin it (0..{EP - 1})")
    args = parser.parse_args(argv)
    if args.lose_rank is not None and not 0 <= args.lose_rank < EP:
        parser.error(f"--lose-rank must be in [0, {EP}), got {args.lose_rank}")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fdeplb.placement import initial_placement
    from fdeplb.store import Deadlines, EmbeddedRedis

    t_start = time.monotonic()
    load_start = round(os.getloadavg()[0], 2)  # the host's 1-minute load average, at the start and at the end
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # 4 worker processes on few cores: one compute thread each
    # the workers' agents serve their live slots to each other and take moved experts from them (README "Moving
    # experts from peers"); the secret authenticates them, and every worker inherits it
    os.environ.setdefault("FDEPLB_PEER_SECRET", secrets.token_hex(16))
    dist, source = expert_distribution()
    # --lose-rank: a lost rank is suspected 5 s after its last heartbeat and excluded 5 s later (a worker starting
    # paddle beside 4 others on 2 cores can hold the rest 2 s and more: shorter TTLs suspect healthy ranks)
    deadlines = Deadlines(collecting_ms=30_000, loading_ms=30_000, swapping_ms=30_000, exclude_ms=5_000)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis() as server:
        if args.lose_rank is None:
            node = Node(tmp, server.url, initial_placement(L, E, P).phy2log, deadlines, dist, 10_000, with_probe=True)
            summary, ok = changes(node)
        else:
            node = Node(tmp, server.url, ELASTIC_PHY2LOG, deadlines, dist, 5_000)
            summary, ok = lose_rank(node, args.lose_rank)
        summary.update({"load_source": source, "loadavg_1m": [load_start, round(os.getloadavg()[0], 2)],
                        "wall_s": round(time.monotonic() - t_start, 1), "ok": ok})
        print(json.dumps(summary))
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
