"""A local simulated serving cluster: real Redis, one real OS process per EP rank, one coordinator.

Used by ``fdeplb demo`` and the end-to-end tests. Every rank runs :mod:`fdeplb.sim.worker` (a rank agent holding
real paddle slot tensors loaded from a real safetensors checkpoint); they meet only through Redis.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from fdeplb.errors import DeadlineError, FdeplbError
from fdeplb.reaper import Reaper
from fdeplb.machines.tables import CLUSTER, RANK, ClusterState, RankState
from fdeplb.orchestration.coordinator import Coordinator
from fdeplb.orchestration.cluster_setup import init_cluster
from fdeplb.orchestration.peer_agent import ENV_PEER_SECRET
from fdeplb.store import AuditRecord, ClusterConfig, Cursor, Store


@dataclass
class LocalCluster:
    """Start/stop helper for a simulated cluster of ``config.ep_size`` worker processes.

    ``workdir`` holds worker logs; ``trace`` is the expert-load dump every worker takes its share of.
    """

    store: Store
    redis_url: str
    config: ClusterConfig
    trace: str | list[str]
    workdir: Path
    seed: int = 0
    backend: str = "paddle"  # the workers' live experts: "paddle" tensors or "numpy" (fdeplb.testing)
    #: the workers' peer-transfer secret (FDEPLB_PEER_SECRET): they take moved experts from each other's live slots;
    #: None = as the environment says (unset: every moved expert from the checkpoint)
    peer_secret: str | None = None
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)

    def init(self, initial_phy2log: np.ndarray) -> None:
        init_cluster(self.store, self.config, initial_phy2log)

    def start_rank(self, ep_rank: int, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start (or restart) the worker process of ``ep_rank``; its log goes to ``workdir/rank<r>.log``.
        ``env`` adds environment variables (e.g. ``FDEPLB_FAILPOINTS``)."""
        log = open(self.workdir / f"rank{ep_rank}.log", "ab")
        traces = [self.trace] if isinstance(self.trace, str) else list(self.trace)
        cmd = [sys.executable, "-m", "fdeplb.sim.worker", "--redis-url", self.redis_url,
               "--cluster", self.store.cluster, "--rank", str(ep_rank), "--seed", str(self.seed),
               "--backend", self.backend,
               *[x for t in traces for x in ("--trace", t)], *extra]
        if ep_rank in self.procs:  # a restart: supersede the agent it replaces (whose heartbeat may be fresh yet)
            cmd.append("--replace")
        peers = {ENV_PEER_SECRET: self.peer_secret} if self.peer_secret else {}
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **peers, **(env or {}))
        proc = subprocess.Popen(cmd + ["--parent-pid", str(os.getpid())], stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        log.close()
        Reaper.shared().watch_pid(proc.pid)  # and the worker watches us: neither outlives this process
        self.procs[ep_rank] = proc
        return proc

    def start_ranks(self) -> None:
        for r in range(self.config.ep_size):
            self.start_rank(r)

    def wait_ready(self, ranks: list[int] | None = None, timeout_s: float = 180.0,
                   after: Cursor | None = None, progress: Callable[[int, int], None] | None = None) -> None:
        """Block until each of ``ranks`` (default: all) announced ``rank_ready`` after the stream position
        ``after`` (default: since the events stream began); ``progress(ready, wanted)`` is called as each one
        does. DeadlineError on timeout, FdeplbError if a worker exits first (its log tail in the message)."""
        want = set(range(self.config.ep_size) if ranks is None else ranks)
        deadline = time.monotonic() + timeout_s
        cursor = dict(after) if after is not None else self.store.cursor(events_from="0-0")
        ready: set[int] = set()
        while not want <= ready:
            for r in want - ready:
                proc = self.procs.get(r)
                if proc is not None and proc.poll() is not None:
                    raise FdeplbError(f"rank {r} exited with {proc.returncode}:\n{self.log_tail(r)}")
            if time.monotonic() > deadline:
                raise DeadlineError(f"ranks not ready after {timeout_s}s: {sorted(want - ready)}")
            for entry in self.store.wait(cursor, 500):
                if entry["kind"] == "rank_ready" and int(entry["rank"]) in want - ready:
                    ready.add(int(entry["rank"]))
                    if progress is not None:
                        progress(len(ready), len(want))

    def log_tail(self, ep_rank: int, lines: int = 20) -> str:
        path = self.workdir / f"rank{ep_rank}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def kill_rank(self, ep_rank: int, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[ep_rank]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=30)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every worker, then SIGKILL whatever is left after ``timeout_s``."""
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def run_round(self, timeout_s: float = 300.0, coordinator: Coordinator | None = None,
                  on_transition: Callable[[AuditRecord], None] | None = None) -> dict:
        """Request one round and run an in-process coordinator until it is back in FREE; returns the final
        cluster record as a dict. ``on_transition(audit_record)`` is called for each cluster transition as it
        commits. DeadlineError if the round does not end within ``timeout_s``."""
        target = self.store.read_cluster().round + 1
        cursor = self.store.cursor()
        self.store.request_round(reason="demo")
        coord = coordinator or Coordinator(self.store)
        end = time.monotonic() + timeout_s

        def finished() -> bool:
            cur = self.store.read_cluster()
            if cur.state is ClusterState.FREE and cur.round >= target:
                return True
            if time.monotonic() > end:
                return True
            return any(p.poll() is not None for p in self.procs.values())

        thread = threading.Thread(target=coord.run, kwargs={"until": finished}, daemon=True)
        thread.start()
        hard_end = end + 30
        try:
            while thread.is_alive() and time.monotonic() < hard_end:
                for entry in self.store.wait(cursor, 250):
                    if on_transition is not None and entry["machine"] == CLUSTER.name:
                        on_transition(entry)
        finally:  # also on SIGTERM/SIGINT in the main thread: stop the coordinator before Redis goes away
            coord.stop_event.set()
            thread.join(1)
        cur = self.store.read_cluster()
        if not (cur.state is ClusterState.FREE and cur.round >= target):
            dead = {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}
            detail = "".join(f"\nrank {r} exited {rc}:\n{self.log_tail(r)}" for r, rc in dead.items())
            raise DeadlineError(f"round {target} did not finish within {timeout_s}s (state {cur.state}){detail}")
        return dataclasses.asdict(cur)

    def wait_ranks_idle(self, timeout_s: float = 60.0) -> None:
        """Block until every rank record is back in IDLE (ranks finish their round after the cluster)."""
        cursor = self.store.cursor()
        end = time.monotonic() + timeout_s
        while True:
            states = [r.state for r in self.store.read_all(RANK)]
            if all(s is RankState.IDLE for s in states):
                return
            if time.monotonic() > end:
                raise DeadlineError(f"ranks not IDLE after {timeout_s}s: {states}")
            self.store.wait(cursor, 500)


def new_cluster_id(prefix: str = "demo") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def temp_workdir(prefix: str = "fdeplb-") -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))

