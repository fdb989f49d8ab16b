"""Regenerate the recordings of tests/replays/ from the real system (never write one by hand).

Each scenario runs a real cluster (coordinator and rank agents as threads of this process, each with its own Redis
connection, the numpy weight backend) against an embedded redis-server, then exports the cluster's audit with
``fdeplb.recording.export_recording``, exactly as ``fdeplb audit --export`` does.

    PYTHONPATH=. python tests/replays/generate.py            # every scenario
    PYTHONPATH=. python tests/replays/generate.py happy      # only these

Scenarios (file = <name>.jsonl):
- happy: one full round, every rank swaps;
- load_failed: rank 1 cannot stage (staging budget of 1 byte), the round aborts with its reason;
- takeover: the first coordinator dies holding the lease once the round is LOADING; a second one takes the lease
  over when it lapses (new fence) and finishes the round;
- gated_skip: min_gain 1.0: the round is planned and skipped as not worth it (audited, placement kept);
- stale_rank: TODO: a start refused while a rank's heartbeat is stale (the guard comes with the embedding issue:
  add it here once ``fdeplb.orchestration`` refuses such a start);
- still to add once the HTTP and embedding issues land: a weight clear and update, a cordoned round committed over
  HTTP.
"""

from __future__ import annotations

import sys
import tempfile
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root: fdeplb and tests.helpers

from fdeplb.orchestration.coordinator import Coordinator  # noqa: E402
from fdeplb.recording import export_recording  # noqa: E402
from fdeplb.store import Store  # noqa: E402
from tests.helpers import thread_cluster, wait_for  # noqa: E402

TIMEOUT_S = 120


def round_over(store: Store, round_: int, ep_size: int):
    def done() -> bool:
        rec = store.read_cluster()  # one read: no race between state and round
        return (rec.state == rec.state.FREE and rec.round >= round_
                and all(store.read_rank(r).state == "IDLE" for r in range(ep_size)))
    return done


def happy(url: str, cluster: str, tmp: Path, out: Path) -> dict:
    with thread_cluster(url, cluster, tmp) as tc:
        store = tc.store()
        tc.start()
        store.request_round("generate: happy")
        wait_for(round_over(store, 1, 4), TIMEOUT_S, store, "round 1 over")
        tc.stop()
        assert store.current_placement().plan_id, "the round did not commit"
        return export_recording(store, out)  # inside: thread_cluster deletes the cluster on exit


def load_failed(url: str, cluster: str, tmp: Path, out: Path) -> dict:
    with thread_cluster(url, cluster, tmp) as tc:
        store = tc.store()
        for r in range(4):
            tc.start_agent(r, **({"staging_budget_bytes": 1} if r == 1 else {}))
        tc.start_coordinator()
        store.request_round("generate: load_failed")
        wait_for(round_over(store, 1, 4), TIMEOUT_S, store, "round 1 aborted")
        tc.stop()
        assert "failed to load" in store.read_cluster().reason
        return export_recording(store, out)  # inside: thread_cluster deletes the cluster on exit


def takeover(url: str, cluster: str, tmp: Path, out: Path) -> dict:
    with thread_cluster(url, cluster, tmp) as tc:
        store = tc.store()
        tc.start_agents()
        first = Coordinator(tc.store(), holder="coordinator-first", lease_ms=1_500)
        store.request_round("generate: takeover")
        # the first coordinator leads until the round is LOADING, then dies holding its lease (no release)
        wait_for(lambda: (first.ensure_leadership() and first.step() and False)
                 or store.read_cluster().state == "LOADING", TIMEOUT_S, store, "LOADING under the first")
        tc.start_coordinator(holder="coordinator-second")
        wait_for(round_over(store, 1, 4), TIMEOUT_S, store, "round 1 finished by the second")
        tc.stop()
        fences = {a["fence"] for a in store.iter_audit() if a["machine"] == "cluster"}
        assert len(fences) == 2, fences
        return export_recording(store, out)  # inside: thread_cluster deletes the cluster on exit


def gated_skip(url: str, cluster: str, tmp: Path, out: Path) -> dict:
    with thread_cluster(url, cluster, tmp, min_gain=1.0) as tc:
        store = tc.store()
        tc.start()
        store.request_round("generate: gated_skip")
        wait_for(round_over(store, 1, 4), TIMEOUT_S, store, "round 1 gated")
        tc.stop()
        assert store.read_cluster().reason.startswith("gated:")
        return export_recording(store, out)  # inside: thread_cluster deletes the cluster on exit


SCENARIOS = {"happy": happy, "load_failed": load_failed, "takeover": takeover, "gated_skip": gated_skip}


def main(names: list[str]) -> int:
    from fdeplb.store.embedded import EmbeddedRedis

    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fdeplb-replays-") as tmp, EmbeddedRedis(Path(tmp) / "redis") as server:
        for name in names or list(SCENARIOS):
            cluster = f"rec-{name}-{uuid.uuid4().hex[:6]}"
            counts = SCENARIOS[name](server.url, cluster, Path(tmp) / name, HERE / f"{name}.jsonl")
            print(f"{name:<12} {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
