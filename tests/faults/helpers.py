"""What the fault suites share: a coordinator process and its stop, waiting on an event of the cluster's stream
with a deadline, and a round's gate made to let a planned round through."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from fdeplb.store import Store
from tests.helpers import wait_for


def spawn_coordinator(cluster, holder: str, failpoints: str = "", lease_ms: int = 1_000) -> subprocess.Popen:
    log = open(cluster.workdir / f"{holder}.log", "ab")
    env = dict(os.environ, FDEPLB_FAILPOINTS=failpoints, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fdeplb", "coordinator", "--redis-url", cluster.redis_url, "--cluster",
         cluster.store.cluster, "--holder", holder, "--lease-ms", str(lease_ms), "--log-level", "INFO"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc


def stop_process(proc: subprocess.Popen, sig=signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    proc.wait(timeout=30)


def wait_event(store: Store, cursor: dict, timeout_s: float = 60.0, **match) -> dict:
    """Wait for an events-stream entry whose fields include ``match``; returns its fields."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for entry in store.wait(cursor, 500):
            if entry["kind"] and all(entry[k] == str(v) for k, v in match.items()):
                return entry.fields
    raise AssertionError(f"no event {match} within {timeout_s}s")


def skip_round_that_would_be_gated(store: Store) -> None:
    """The workers alternate between two traces by round parity: if the next round would replay the trace of
    the current placement's round (a plan that moves nothing, gated), run that gated round first. Needs a
    coordinator running."""
    plan_id = store.current_placement().plan_id
    rec = store.read_cluster()
    if not plan_id:
        return
    planned_round = store.read_plan(plan_id).round
    if (rec.round + 1 - planned_round) % 2 == 0:
        store.request_round(reason="skip a gated round")
        wait_for(settled(store, rec.round + 1), 60, store, "the gated round")
        assert "gated" in last_cluster_transition(store)["reason"]


def settled(store: Store, round_: int):
    """A predicate: the cluster is FREE at round ``round_`` or later and every rank IDLE."""
    def check():
        rec = store.read_cluster()
        ranks = [store.read_rank(r) for r in range(store.read_config().ep_size)]
        return rec.state == "FREE" and rec.round >= round_ and all(r.state == "IDLE" for r in ranks)
    return check


def last_cluster_transition(store: Store):
    return [a for a in store.iter_audit() if a["machine"] == "cluster" and a["trigger"] != "alarm"][-1]
