"""Peer-transfer benchmark: one EP rank stages the experts a DeepSeek-V3 drift moves to it from the live slots of the
peer ranks that hold them, served by real worker processes of this machine.

Drift pair as ``benchmarks/swap.py``: SGLang's DeepSeek-V3 expert-load dumps (``$FDEPLB_REAL_DATA`` or
../shared/real_data/dsv3_sglang_ep_stats; prefill_in1024 -> decode_in1000out1000), placed with DeepSeek's EPLB on
32 GPUs / 4 nodes / 288 slots. To stay within a couple of minutes on 2 cores, only the first ``--layers`` MoE layers
(default 8 of 58) are used, expert shapes are DeepSeek-V3's divided by ``--scale`` (default 16: 336 KiB bf16 experts),
and the peer ranks the measured rank takes experts from are hosted ``--procs`` (default 4) worker processes, each
running the :class:`~fdeplb.weights.peer.PeerServer` of several ranks over their live slots
(:class:`~fdeplb.weights.CheckpointBackend`, loaded and verified from a synthetic checkpoint). The measured rank is
the one that moves most experts (``--rank`` to choose).

- ``peer_s``: the production staging path (``CheckpointBackend.stage(new, peers=...)``: sources from
  :func:`~fdeplb.weights.peer_plan.peer_sources`, connect + HMAC handshake per peer, one request and one header
  per batch of up to 64 experts of a peer, bytes received into staging tensors (the reader's recycled buffers, as
  after a swap: one untimed staging first), CRC-32C of each expert checked as it arrives against the peer's and
  the receiver's checkpoint checksum), best of ``--repeats``;
- ``raw_s``: the same transport (``multiprocessing.connection``, authenticated) moving the same bytes in the same
  frames between the same processes, one thread per peer as staging, into pre-faulted buffers holding all of them
  (as staging holds them), with no request per expert, no allocation and no check, best of ``--repeats``,
  interleaved with ``peer_s`` run by run, after one untimed run of each; ``peer_vs_raw = peer_s / raw_s``
  (target <= 1.25);
- ``disk_bytes``: bytes staging still read from the checkpoint (0 when every moved expert has a live holder);
- ``verified``: every staged expert's checksum equals the checkpoint's (read from disk after the timing);
- ``fallback_ok``: one more staging with the busiest peer's process started with the failpoint ``peer.hang=sending``
  and SIGKILLed once it hangs mid-expert: staging completes, the killed peer's experts come from disk, verified.

    python benchmarks/peer_transfer.py [--layers 8] [--scale 16] [--procs 4] [--repeats 3] [--rank R]

Prints a table, then one machine-readable JSON line (the last line).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path

import numpy as np

import swap as cpu_bench  # benchmarks/swap.py (same folder): drift pair, table; puts the repo on sys.path

from fdeplb.placement.digest import routing_digest  # noqa: E402
from fdeplb.weights import CheckpointBackend, CheckpointReader, expert_checksum, plan_transfer  # noqa: E402
from fdeplb.weights import write_synthetic_checkpoint  # noqa: E402
from fdeplb.weights import _paddle  # noqa: E402
from fdeplb.weights.peer import PeerServer, SocketTransport, peer_authkey  # noqa: E402
from fdeplb.weights.peer_plan import CHECKPOINT, peer_sources  # noqa: E402
from fdeplb.weights.peer_staging import PeerFetch  # noqa: E402

REPO, REAL_DATA, DSV3 = cpu_bench.REPO, cpu_bench.REAL_DATA, cpu_bench.DSV3
EP_SIZE = DSV3["num_gpus"]
SECRET = "peer-transfer-benchmark"
CLUSTER = "bench"
KEY = peer_authkey(SECRET, CLUSTER)


def placements(old_file: str, new_file: str, layers: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(old phy2log, new phy2log, num_logical_experts) of the drift pair (:func:`swap.placements`), first
    ``layers`` MoE layers (DeepSeek's EPLB places each layer on its own)."""
    old, new, num_experts = cpu_bench.placements(old_file, new_file)
    return old[:layers], new[:layers], num_experts


# ---- the worker processes -----------------------------------------------------------------------------------------
def serve(args: argparse.Namespace) -> int:
    """A worker process: the live slots and PeerServer of each of ``--serve-ranks``, and a raw listener; prints
    ``READY rank peer_address raw_address`` per rank, then ``SERVING``; serves until stdin closes."""
    old = np.load(Path(args.ckpt) / "old.npy")
    raw = Listener(("127.0.0.1", 0), authkey=KEY, backlog=64)
    raw_address = "%s:%d" % raw.address
    threading.Thread(target=_raw_accept, args=(raw,), daemon=True).start()
    servers = []
    for r in (int(x) for x in args.serve_ranks.split(",")):
        backend = CheckpointBackend.open({"path": args.ckpt}, old, r, EP_SIZE)
        servers.append(PeerServer(backend, KEY))
        print("READY", r, servers[-1].address, raw_address, flush=True)
    print("SERVING", flush=True)
    sys.stdin.read()
    return 0


def _raw_accept(listener: Listener) -> None:
    while True:
        conn = listener.accept()
        threading.Thread(target=_raw_send, args=(conn,), daemon=True).start()


def _raw_send(conn) -> None:
    """Send frames of the sizes asked (one request: a JSON list of sizes) from one pre-faulted buffer."""
    try:
        while True:
            sizes = json.loads(conn.recv_bytes())
            buf = bytearray(max(sizes, default=0)) or bytearray(1)
            for n in sizes:
                conn.send_bytes(buf, 0, n)
    except (EOFError, OSError):
        conn.close()


class Workers:
    """The worker processes, with their output read line by line (waits with deadlines)."""

    def __init__(self, ckpt: str, groups: list[list[int]], env: dict | None = None) -> None:
        self.procs, self.lines = [], queue.Queue()
        full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        for ranks in groups:
            p = subprocess.Popen([sys.executable, __file__, "--serve", "--ckpt", ckpt,
                                  "--serve-ranks", ",".join(map(str, ranks))], env=full, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            threading.Thread(target=lambda p=p: [self.lines.put((p, line)) for line in p.stdout], daemon=True).start()
            self.procs.append(p)
        self.peer, self.raw = {}, {}
        serving = 0
        while serving < len(self.procs):
            _, line = self.wait_for(("READY", "SERVING"), 600)
            if line.startswith("SERVING"):
                serving += 1
            else:
                _, r, peer, raw = line.split()
                self.peer[int(r)], self.raw[int(r)] = peer, raw

    def wait_for(self, texts: tuple[str, ...], timeout_s: float) -> tuple:
        end = time.monotonic() + timeout_s
        while True:
            try:
                p, line = self.lines.get(timeout=max(end - time.monotonic(), 0.01))
            except queue.Empty:
                raise SystemExit(f"workers printed none of {texts} within {timeout_s} s") from None
            if any(t in line for t in texts):
                return p, line.strip()
            if "Error" in line or "Traceback" in line:
                print(line.rstrip(), file=sys.stderr)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


# ---- the measured rank ----------------------------------------------------------------------------------------------
def stage_from_peers(backend: CheckpointBackend, new: np.ndarray, sources: dict, addresses: dict[int, str]):
    """(seconds, staged) of one staging of ``new`` with experts from ``addresses``' peers."""
    transport = SocketTransport(addresses, KEY, timeout_s=60)
    fetch = PeerFetch(transport, sources, routing_digest(backend.phy2log))
    t0 = time.perf_counter()
    try:
        staged = backend.stage(new, None, peers=fetch)
    finally:
        transport.close()
    return time.perf_counter() - t0, staged


def raw_transfer(frames: list[tuple[str, list[int]]], buffers: list[bytearray]) -> float:
    """Seconds to move ``frames`` ((raw address, frame sizes) per peer) one thread per peer, into ``buffers``."""
    def one(address: str, sizes: list[int], buf: bytearray) -> None:
        host, _, port = address.rpartition(":")
        with Client((host, int(port)), authkey=KEY) as conn:
            conn.send_bytes(json.dumps(sizes).encode())
            view, at = memoryview(buf), 0
            for n in sizes:
                conn.recv_bytes_into(view[at:at + n])
                at += n

    threads = [threading.Thread(target=one, args=(a, s, b)) for (a, s), b in zip(frames, buffers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def verified(reader: CheckpointReader, disk: tuple, staged) -> bool:
    """Every staged expert's checksum is the checkpoint's (read from disk, after the timing)."""
    truth = reader.read_experts(list(disk), on_read=expert_checksum)
    return [c for _, c in truth] == list(staged.experts.checksums)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", default="prefill_in1024.json")
    ap.add_argument("--new", default="decode_in1000out1000.json")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--scale", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--serve-ranks", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        raise SystemExit(serve(args))
    if not REAL_DATA.is_dir():
        print(f"real data not found at {REAL_DATA} (set FDEPLB_REAL_DATA)", file=sys.stderr)
        raise SystemExit(2)
    old, new, num_experts = placements(args.old, args.new, args.layers)
    moved = [len(plan_transfer(old, new, r, EP_SIZE).disk) for r in range(EP_SIZE)]
    rank = int(np.argmax(moved)) if args.rank is None else args.rank
    sources = peer_sources(old, new, rank, EP_SIZE, range(EP_SIZE))
    peers = sorted(set(sources.values()) - {CHECKPOINT})
    per_rank = old.shape[1] // EP_SIZE
    needed = {(layer, int(e)) for r in [*peers, rank] for layer in range(old.shape[0])
              for e in old[layer, r * per_rank:(r + 1) * per_rank]}
    needed |= {(layer, int(e)) for layer in range(new.shape[0])
               for e in new[layer, rank * per_rank:(rank + 1) * per_rank]}
    hidden, inter = DSV3["hidden"] // args.scale, DSV3["intermediate"] // args.scale
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        write_synthetic_checkpoint(tmp, old.shape[0], num_experts, hidden=hidden, intermediate=inter,
                                   dtype=args.dtype, experts=needed, experts_per_shard=256)
        np.save(Path(tmp) / "old.npy", old)
        groups = [peers[i::args.procs] for i in range(min(args.procs, len(peers)))]
        t0 = time.perf_counter()
        workers = Workers(tmp, groups)
        start_s = time.perf_counter() - t0
        try:
            backend = CheckpointBackend.open({"path": tmp}, old, rank, EP_SIZE)
            reader = backend.reader
            plan = plan_transfer(old, new, rank, EP_SIZE)
            nbytes = reader.expert_nbytes
            sizes = [_paddle.nbytes(t) for t in backend.live.slot(0, 0).values()]
            frames: dict[int, list[int]] = {}  # peer -> the frames staging receives from it, in order
            for key in plan.disk:
                if sources[key] != CHECKPOINT:
                    frames.setdefault(sources[key], []).extend(sizes)
            raw_frames = [(workers.raw[p], f) for p, f in sorted(frames.items())]
            buffers = [bytearray(sum(f)) for _, f in raw_frames]  # the bytes kept, as staging keeps them
            peer_runs, raw_runs, staged_report, ok = [], [], None, True
            _, staged = stage_from_peers(backend, new, sources, workers.peer)  # warm-up of both, not timed: every
            staged.experts.release(keep_buffers=True)  # timed staging then fills recycled, pre-faulted buffers
            raw_transfer(raw_frames, buffers)  # as the raw transport's are (they were zeroed when allocated)
            for i in range(args.repeats):
                seconds, staged = stage_from_peers(backend, new, sources, workers.peer)
                peer_runs.append(seconds)
                if i == 0:
                    staged_report, fallbacks = staged.report, list(staged.fallbacks)
                    ok = verified(reader, plan.disk, staged)
                staged.experts.release(keep_buffers=True)  # as after a swap: the next staging reuses its buffers
                raw_runs.append(raw_transfer(raw_frames, buffers))
            fallback = fallback_run(tmp, backend, reader, new, sources, plan, workers)
        finally:
            workers.close()
    peer_s, raw_s = min(peer_runs), min(raw_runs)
    result = {
        "benchmark": "peer_transfer",
        "drift": f"{args.old} -> {args.new}",
        "layers": args.layers, "scale": args.scale, "dtype": args.dtype, "rank": rank, "peers": len(peers),
        "procs": len(groups), "expert_nbytes": nbytes, "moved_experts": len(plan.disk),
        "peer_s": round(peer_s, 4), "raw_s": round(raw_s, 4), "peer_vs_raw": round(peer_s / raw_s, 3),
        "peer_runs_s": [round(s, 4) for s in peer_runs], "raw_runs_s": [round(s, 4) for s in raw_runs],
        "peer_bytes": staged_report.peer_bytes, "disk_bytes": staged_report.disk_bytes,
        "fallbacks_without_faults": len(fallbacks), "verified": bool(ok and not fallbacks),
        "fallback_ok": fallback["ok"], "fallback": fallback, "workers_start_s": round(start_s, 2),
    }
    mib = cpu_bench.mib
    rows = [
        ("drift", result["drift"]),
        ("topology", f"32 GPUs, 4 nodes, 288 slots; first {args.layers} of 58 MoE layers"),
        ("measured rank", f"{rank}: {len(plan.disk)} moved experts from {len(peers)} peers in {len(groups)} processes"),
        ("expert", f"{mib(nbytes)} ({args.dtype}, DeepSeek-V3 shapes / {args.scale})"),
        ("bytes from peers / disk", f"{mib(staged_report.peer_bytes)} / {mib(staged_report.disk_bytes)}"),
        ("stage from peers (peer_s)", f"{peer_s * 1e3:,.1f} ms (best of {args.repeats})"),
        ("raw transport (raw_s)", f"{raw_s * 1e3:,.1f} ms (best of {args.repeats})"),
        ("peer / raw", f"{peer_s / raw_s:.2f} ({'PASS' if peer_s / raw_s <= 1.25 else 'FAIL'}, target <= 1.25)"),
        ("verified", str(result["verified"])),
        ("peer SIGKILLed mid-transfer", f"{fallback['fallbacks']} experts from disk, verified: {fallback['ok']}"),
    ]
    cpu_bench.print_table(rows, result)
    return result


def fallback_run(ckpt: str, backend, reader, new, sources, plan, workers: Workers) -> dict:
    """Stage once more with the busiest peer replaced by a process armed with ``peer.hang=sending``, SIGKILL it once
    it hangs mid-expert; the staging must complete, its experts from disk, every checksum the checkpoint's."""
    victim = max(set(sources.values()) - {CHECKPOINT}, key=lambda p: (list(sources.values()).count(p), -p))
    armed = Workers(ckpt, [[victim]], env={"FDEPLB_FAILPOINTS": "peer.hang=sending"})
    out: dict = {}
    addresses = {**workers.peer, victim: armed.peer[victim]}
    t = threading.Thread(target=lambda: out.update(run=stage_from_peers(backend, new, sources, addresses)))
    try:
        t.start()
        proc, _ = armed.wait_for(("failpoint hit",), 120)
        proc.send_signal(signal.SIGKILL)
        t.join(120)
    finally:
        armed.close()
    if "run" not in out:
        return {"ok": False, "fallbacks": 0, "victim": victim}
    _, staged = out["run"]
    ok = (staged.report.disk > 0 and all(f.peer == victim for f in staged.fallbacks)
          and verified(reader, plan.disk, staged))
    result = {"ok": bool(ok), "victim": victim, "fallbacks": len(staged.fallbacks),
              "disk_bytes": staged.report.disk_bytes}
    staged.release()
    return result


if __name__ == "__main__":
    main()
