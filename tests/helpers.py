"""Test helpers: an in-process cluster (coordinator + rank agents in threads, real Redis, real paddle tensors)."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import redis

from fdeplb.errors import CheckpointError
from fdeplb.orchestration.agent import RankAgent
from fdeplb.orchestration.coordinator import Coordinator
from fdeplb.orchestration.cluster_setup import init_cluster
from fdeplb.store import ClusterConfig, Deadlines, Store
from fdeplb.store.keys import Keys
from fdeplb.store.scripts import script_text
from fdeplb.testing import NumpyWeights


#: the long-run profile (README "Tests"): ``FDEPLB_FAULTS=short`` (the default, CI) runs a few of each long loop,
#: ``FDEPLB_FAULTS=full`` the counts of the issues
FAULTS_PROFILE = os.environ.get("FDEPLB_FAULTS", "short")
if FAULTS_PROFILE not in ("short", "full"):
    raise RuntimeError(f"FDEPLB_FAULTS must be short or full, got {FAULTS_PROFILE!r}")


class RawRedis:
    """Test-only direct access to one cluster's keys, beside the store: set-up that skips the machines, corrupted
    values, and DUMP snapshots to prove a refused call changed nothing."""

    def __init__(self, url: str, cluster: str) -> None:
        self.r = redis.Redis.from_url(url)
        self.keys = Keys(cluster)
        self.cluster = cluster

    def force(self, key: str, state: str, version: int = 5, **fields) -> None:
        """Put a record in a state without a transition."""
        self.r.hset(key, mapping={"state": str(state), "version": str(version), **fields})

    def snapshot(self) -> dict:
        """DUMP of every key of the cluster but the (wake-up) events stream."""
        keys = sorted(self.r.scan_iter(match=f"fdeplb:[{{]{self.cluster}[}}]:*"))
        return {k: self.r.dump(k) for k in keys if not k.endswith(b":events")}

    def audit_len(self) -> int:
        return int(self.r.xlen(self.keys.audit))


def wait_for(predicate, timeout_s: float = 30.0, store: Store | None = None, what: str = "condition"):
    """Wait until ``predicate()`` is truthy, blocking on the cluster's streams between checks when a store is
    given; fails the test with ``what`` after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    cursor = store.cursor() if store is not None else None
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        if store is not None:
            store.wait(cursor, 200)
        else:
            time.sleep(0.02)


class FailingReload(NumpyWeights):
    """The numpy weight backend of a rank whose weight update cannot read the checkpoint (a shard is missing):
    staging and swaps work, ``reload_in`` raises :class:`CheckpointError`."""

    def reload_in(self, phy2log):
        raise CheckpointError("shard model-00002.safetensors is missing")


def skewed_load(num_layers: int, num_experts: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.zipf(1.6, size=(num_layers, num_experts)) * 100).astype(np.int64)


@dataclass
class ThreadCluster:
    """Coordinator and rank agents as threads of the test process, each with its own Redis connection."""

    url: str
    cluster: str
    config: ClusterConfig
    loads: np.ndarray  # int64 [ep_size, L, E]
    backend: str = "numpy"  # "numpy" (fdeplb.testing.NumpyWeights) or "paddle" (checkpoint tensors)
    agents: list[RankAgent] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    coordinator: Coordinator | None = None

    def store(self) -> Store:
        return Store(self.url, self.cluster)

    def start_agents(self, ranks=None, **kwargs) -> None:
        for r in ranks if ranks is not None else range(self.config.ep_size):
            self.start_agent(r, **kwargs)

    def start_agent(self, r: int, **kwargs) -> RankAgent:
        """Start (or, after its thread stopped, restart) the agent of rank ``r``, as a fresh process would."""
        kwargs.setdefault("verify_all", True)
        kwargs.setdefault("replace", any(a.ep_rank == r for a in self.agents))  # a restart supersedes on purpose
        if self.backend == "numpy":
            kwargs.setdefault("backend_factory", NumpyWeights.factory())
        agent = RankAgent(self.store(), r, load_source=lambda _round: self.loads[r], **kwargs)
        agent.start()
        t = threading.Thread(target=agent.run, kwargs={"block_ms": 200}, daemon=True, name=f"rank{r}")
        t.start()
        self.agents.append(agent)
        self.threads.append(t)
        return agent

    def start_silent_rank(self, r: int) -> None:
        """Rank ``r`` registered with a fresh heartbeat (TTL 1 h) but no agent: a rank that is up, so the start
        guard lets a round start, and never publishes its load (the start guard refuses an unregistered rank)."""
        store = self.store()
        store.register_rank(r, {"agent_id": f"silent-{r}"})
        store.heartbeat(r, heartbeat_ttl_ms=3_600_000)

    def start_coordinator(self, **kwargs) -> Coordinator:
        self.coordinator = Coordinator(self.store(), lease_ms=kwargs.pop("lease_ms", 1_500), **kwargs)
        t = threading.Thread(target=self.coordinator.run, daemon=True, name="coordinator")
        t.start()
        self.threads.append(t)
        return self.coordinator

    def start(self, **agent_kwargs) -> "ThreadCluster":
        """Start every rank agent and a coordinator."""
        self.start_agents(**agent_kwargs)
        self.start_coordinator()
        return self

    def stop(self) -> None:
        for a in self.agents:
            a.stop_event.set()
        if self.coordinator is not None:
            self.coordinator.stop_event.set()
        for t in self.threads:
            t.join(timeout=10)


@contextmanager
def thread_cluster(url: str, cluster: str, tmp_path: Path, *, num_layers: int = 3, num_experts: int = 16,
                   num_redundant: int = 4, ep_size: int = 4, policy: str = "deepseek", cordoned: bool = False,
                   deadlines: Deadlines | None = None, min_gain: float = 0.0, seed: int = 0, num_groups: int = 1,
                   backend: str = "numpy", ready_to_clean_up=None, retain_rounds: int = 3, num_nodes: int = 1):
    """A small initialised cluster; yields a :class:`ThreadCluster` (nothing started). ``backend="paddle"``
    writes a real safetensors checkpoint and gives the agents paddle tensors; "numpy" needs no paddle.
    ``ready_to_clean_up``: a condition awaited (:func:`wait_for`, 60 s) before the cluster's keys are deleted at
    the end, e.g. the end of a Sentinel failover (until then the store finds no master to delete them on)."""
    from fdeplb.placement import initial_placement

    checkpoint = {}
    if backend == "paddle":
        from fdeplb.weights import write_synthetic_checkpoint

        ckpt = write_synthetic_checkpoint(tmp_path / "ckpt", num_layers, num_experts, hidden=8, intermediate=4)
        checkpoint = {"path": str(ckpt), "preset": "ernie"}
    config = ClusterConfig(num_layers=num_layers, num_logical_experts=num_experts,
                           num_physical_experts=num_experts + num_redundant, ep_size=ep_size, policy=policy,
                           checkpoint=checkpoint, cordoned=cordoned,
                           deadlines=deadlines or Deadlines(collecting_ms=20_000, loading_ms=20_000,
                                                            commit_ms=20_000, swapping_ms=20_000),
                           min_gain=min_gain, num_groups=num_groups, retain_rounds=retain_rounds, num_nodes=num_nodes)
    store = Store(url, cluster)
    init_cluster(store, config, initial_placement(num_layers, num_experts, config.num_physical_experts).phy2log)
    total = skewed_load(num_layers, num_experts, seed)
    rng = np.random.default_rng(seed + 1)
    loads = np.moveaxis(rng.multinomial(total, np.full(ep_size, 1 / ep_size)), -1, 0)
    tc = ThreadCluster(url=url, cluster=cluster, config=config, loads=np.ascontiguousarray(loads), backend=backend)
    try:
        yield tc
    finally:
        tc.stop()
        if ready_to_clean_up is not None:
            wait_for(ready_to_clean_up, 60, what="the topology to be ready for the clean-up")
        store.delete_cluster()


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``fdeplb ARGV`` in-process: (exit code, stdout, stderr); argparse's usage errors give their exit code."""
    from fdeplb.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def within(fn, timeout_s: float = 30.0, *, fifo: Path | None = None):
    """``fn()``'s result (or its exception), run on a daemon thread; AssertionError when it has not returned within
    ``timeout_s`` (it blocked; ``fifo`` is then opened for reading and writing, which lets a reader or a writer
    waiting on it go)."""
    out: dict = {}

    def go():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out["error"] = exc

    t = threading.Thread(target=go, daemon=True, name="within")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
        raise AssertionError(f"{fn} still ran after {timeout_s} s: it blocked")
    if "error" in out:
        raise out["error"]
    return out["value"]


def real_traces_28x64(real_data: Path, workdir: Path) -> list[str]:
    """Two real loads of 28 layers x 64 experts that the rounds alternate between: the Qwen2-57B dumps from
    ../shared/real_data, or, on a plain clone, two 64-expert slices of the DeepSeek-V3 dump bundled in the package
    (measured loads either way), so the process tests (kill, fault suite) run in CI without ../shared."""
    qwen = [real_data / "qwen2_57b_oeplb" / "counts57b.json", real_data / "qwen2_57b_oeplb" / "counts57b_share.json"]
    if all(p.is_file() for p in qwen):
        return [str(p) for p in qwen]
    from fdeplb.placement import read_expert_load

    dump = read_expert_load(real_data / "dsv3_sglang_ep_stats" / "decode_in1000out1000.json").expert_load
    out = []
    for i, experts in enumerate((slice(0, 64), slice(64, 128))):
        path = workdir / f"dsv3_slice{i}.json"
        path.write_text(json.dumps({"counts": dump[:28, experts].tolist()}))
        out.append(str(path))
    return out


def header_slots(script: str, kind: str) -> list[str]:
    """The slot names a script's header documents, in order: ``-- KEYS[3]  name: ...``."""
    found = re.findall(rf"^-- {kind}\[(\d+)\]\s+(\w+):", script_text(script), flags=re.M)
    assert [int(i) for i, _ in found] == list(range(1, len(found) + 1)), found
    return [name for _, name in found]
