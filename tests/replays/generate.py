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
- stale_rank: rank 1's worker stops (its heartbeat lapses): the requested start is refused (``start_refused``);
  the worker comes back and the round starts, its start record showing the heartbeats fresh again;
- weights: a round, then a weight clear (NORMAL -> CLEARING -> CLEARED) and an update in which rank 1 cannot read
  the checkpoint (UPDATING -> CLEARED, update_failed), then rank 1's worker restarts and a second update brings
  every rank back to NORMAL in the round's placement;
- cordoned_http: a cordoned cluster driven over HTTP by an ``fdeplb serve`` process on loopback (credentials in
  the body, as FastDeploy's clients send them): start, LOAD_SUCC, then the commit requested with
  ``update_weight_from_tensor``;
- membership: rank 2's worker dies (4 ranks, 2 layers, 8 experts in 12 slots: experts 6 and 7 only on
  rank 2); the coordinator suspects it, the operator excludes it (``fdeplb rank exclude``), the re-placement round
  commits a placement that routes nothing to it; a new worker for rank 2 rejoins and is admitted; a second round
  runs with every rank (each membership change raises the generation by one);
- weights_cancel: a clear carried out everywhere, an update that rank 1's hung worker never arms for (cancelled
  after ``weights_ms``: ``cancel_to_cleared``), an update carried out, a clear rank 1 never arms for (``cancel``).

stale_rank, weights, cordoned_http and weights_cancel run a smaller cluster (2 ranks, 2 layers, 8 experts + 2
redundant). Every scenario names its policy
(:data:`POLICY`), so a change of the default policy does not change the recordings.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root: fdeplb and tests.helpers

from fdeplb.machines.tables import WeightState  # noqa: E402
from fdeplb.orchestration.coordinator import Coordinator  # noqa: E402
from fdeplb.recording import export_recording  # noqa: E402
from fdeplb.store import Store  # noqa: E402
from tests.helpers import FailingReload, thread_cluster, wait_for  # noqa: E402

TIMEOUT_S = 120
#: the placement policy of every recording, named (not the default: recordings must not follow a default's change)
POLICY = "deepseek"
#: the cluster of the later scenarios: small, so the recordings and the tests replaying them stay small
SMALL = {"num_layers": 2, "num_experts": 8, "num_redundant": 2, "ep_size": 2}


def round_over(store: Store, round_: int, ep_size: int):
    def done() -> bool:
        rec = store.read_cluster()  # one read: no race between state and round
        return (rec.state == rec.state.FREE and rec.round >= round_
                and all(store.read_rank(r).state == "IDLE" for r in range(ep_size)))
    return done


def happy(url: str, cluster: str, tmp: Path, out: Path) -> dict:
    with thread_cluster(url, cluster, tmp, policy=POLICY) as tc:
        store = tc.store()
        tc.start()
        store.request_round("generate: happy")
        wait_for(round_over(store, 1, 4), TIMEOUT_S, store, "round 1 over")
        tc.stop()
        assert store.current_placement().plan_id, "the round did not commit"
        return export_recording(store, out)  # inside: thread_cluster deletes the cluster on exit


def load_failed(url: str, cluster: str, tmp: Path, out: Path) -> dict:
    with thread_cluster(url, cluster, tmp, policy=POLICY) as tc:
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
    with thread_cluster(url, cluster, tmp, policy=POLICY) as tc:
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
    with thread_cluster(url, cluster, tmp, policy=POLICY, min_gain=1.0) as tc:
        store = tc.store()
        tc.start()
        store.request_round("generate: gated_skip")
        wait_for(round_over(store, 1, 4), TIMEOUT_S, store, "round 1 gated")
        tc.stop()
        assert store.read_cluster().reason.startswith("gated:")
        return export_recording(store, out)  # inside: thread_cluster deletes the cluster on exit


def stale_rank(url: str, cluster: str, tmp: Path, out: Path) -> dict:
    with thread_cluster(url, cluster, tmp, policy=POLICY, **SMALL) as tc:
        store = tc.store()
        tc.start_agents(heartbeat_ttl_ms=2_000)
        tc.agents[1].stop_event.set()  # rank 1's worker stops beating; it stays registered
        tc.threads[1].join(10)
        wait_for(lambda: 1 in store.stale_ranks(), TIMEOUT_S, store, "rank 1 stale")
        tc.start_coordinator()
        store.request_round("generate: stale_rank")
        wait_for(lambda: any(a["trigger"] == "start_refused" for a in store.iter_audit()), TIMEOUT_S, store,
                 "the start refused")
        tc.start_agent(1, heartbeat_ttl_ms=2_000)  # the worker comes back: the round starts and completes
        wait_for(round_over(store, 1, 2), TIMEOUT_S, store, "round 1 over")
        tc.stop()
        assert store.current_placement().plan_id, "the round did not commit"
        return export_recording(store, out)


def weights(url: str, cluster: str, tmp: Path, out: Path) -> dict:
    def weights_done(request: int, *states: WeightState):
        return lambda: all((w := store.read_weights(r)).request == request and w.state is state
                           for r, state in enumerate(states))

    with thread_cluster(url, cluster, tmp, policy=POLICY, **SMALL) as tc:
        store = tc.store()
        tc.start_agent(0)
        tc.start_agent(1, backend_factory=FailingReload.factory())  # stages and swaps; cannot reload
        tc.start_coordinator()
        store.request_round("generate: weights")
        wait_for(round_over(store, 1, 2), TIMEOUT_S, store, "round 1 over")
        assert store.current_placement().plan_id, "the round did not commit"
        n = store.request_weights("clear", "generate: weights")
        wait_for(weights_done(n, WeightState.CLEARED, WeightState.CLEARED), TIMEOUT_S, store, "cleared")
        n = store.request_weights("update", "generate: weights")
        wait_for(weights_done(n, WeightState.NORMAL, WeightState.CLEARED), TIMEOUT_S, store, "rank 1 failed")
        tc.agents[1].stop_event.set()  # rank 1's worker restarts with a readable checkpoint
        tc.threads[1].join(10)
        tc.start_agent(1)
        n = store.request_weights("update", "generate: weights")
        wait_for(weights_done(n, WeightState.NORMAL, WeightState.NORMAL), TIMEOUT_S, store, "updated")
        tc.stop()
        return export_recording(store, out)


def cordoned_http(url: str, cluster: str, tmp: Path, out: Path) -> dict:
    import requests

    from tests.api_helpers import CREDS, PASSWORD, USER, free_port, wait_http

    with thread_cluster(url, cluster, tmp, policy=POLICY, cordoned=True, **SMALL) as tc:
        store = tc.store()
        tc.start()
        ips = []
        for r in range(2):  # addresses the API may name (never contacted here)
            store.register_rank(r, {**store.rank_info().get(r, {}), "api_address": f"10.0.0.{r + 1}:8000"})
            ips.append(f"10.0.0.{r + 1}:8000")
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(HERE.parents[1]), "FDEPLB_API_USER": USER,
               "FDEPLB_API_PASSWORD": PASSWORD}
        server = subprocess.Popen([sys.executable, "-m", "fdeplb", "serve", "--redis-url", url, "--cluster", cluster,
                                   "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        api = f"http://127.0.0.1:{port}"
        try:
            wait_http(api, proc=server)
            r = requests.post(f"{api}/rearrange_experts", json={**CREDS, "ips": ips}, timeout=60)
            assert r.status_code == 200 and r.json()["round"] == 1, r.text
            wait_for(lambda: store.read_cluster().state == "LOAD_SUCC", TIMEOUT_S, store, "LOAD_SUCC")
            r = requests.post(f"{api}/check_redundant", json={**CREDS, "action": "check_load_weight_result"},
                              timeout=60)
            assert r.json()["data"] == [1, 1], r.text
            r = requests.post(f"{api}/rearrange_experts", json={**CREDS, "action": "update_weight_from_tensor"},
                              timeout=60)
            assert r.status_code == 200, r.text
            wait_for(round_over(store, 1, 2), TIMEOUT_S, store, "the committed round over")
        finally:
            server.terminate()
            server.wait(30)
        tc.stop()
        assert store.current_placement().plan_id == r.json()["plan_id"]
        return export_recording(store, out)


def membership(url: str, cluster: str, tmp: Path, out: Path) -> dict:
    from fdeplb.cli import main as cli
    from fdeplb.machines.tables import MEMBERSHIP, MemberState
    from fdeplb.placement import live_maps
    from fdeplb.store import Deadlines

    deadlines = Deadlines(collecting_ms=20_000, loading_ms=20_000, commit_ms=20_000, swapping_ms=20_000,
                          exclude_ms=60_000)  # the operator excludes the suspect rank long before this
    with thread_cluster(url, cluster, tmp, policy=POLICY, num_layers=2, num_experts=8, num_redundant=4,
                        deadlines=deadlines) as tc:
        store = tc.store()
        tc.start(heartbeat_ttl_ms=MEMBER_TTL_MS)
        tc.agents[2].stop_event.set()  # rank 2's worker dies; its experts 6 and 7 live only there
        tc.threads[2].join(10)
        wait_for(lambda: store.read(MEMBERSHIP, 2).state is MemberState.SUSPECT, TIMEOUT_S, store, "rank 2 suspect")
        assert cli(["rank", "exclude", "--redis-url", url, "--cluster", cluster, "--rank", "2",
                    "--reason", "generate: membership"]) == 0
        wait_for(round_over(store, 1, 4), TIMEOUT_S, store, "the re-placement round")
        placement = store.current_placement()
        log2phy, _ = live_maps(placement.phy2log, 8, 4, [True, True, False, True])
        assert placement.plan_id and not ((log2phy >= 6) & (log2phy < 9)).any(), "routes to rank 2"
        tc.start_agent(2, heartbeat_ttl_ms=MEMBER_TTL_MS)  # a new worker for rank 2 rejoins
        wait_for(lambda: store.read(MEMBERSHIP, 2).state is MemberState.ACTIVE, TIMEOUT_S, store, "rank 2 back")
        store.request_round("generate: membership")
        wait_for(round_over(store, 2, 4), TIMEOUT_S, store, "round 2 over")
        tc.stop()
        trail = [a["trigger"] for a in store.iter_audit() if a["key"] == "member:2"]
        assert trail == ["suspect", "exclude", "rejoin", "admit"], trail
        return export_recording(store, out)


def weights_cancel(url: str, cluster: str, tmp: Path, out: Path) -> dict:
    from fdeplb.store import Deadlines
    from tests.orchestration.helpers import embedded

    def done(request: int, state: WeightState):
        return lambda: all((w := store.read_weights(r)).request == request and w.state is state for r in range(2))

    deadlines = Deadlines(collecting_ms=20_000, loading_ms=20_000, commit_ms=20_000, swapping_ms=20_000,
                          weights_ms=300)
    with thread_cluster(url, cluster, tmp, policy=POLICY, deadlines=deadlines, **SMALL) as tc:
        store = tc.store()
        tc.start_coordinator()
        for action, serving, state in (("clear", [0, 1], WeightState.CLEARED),  # carried out everywhere
                                       ("update", [0], WeightState.CLEARED),  # rank 1 hung: cancelled to CLEARED
                                       ("update", [0, 1], WeightState.NORMAL),
                                       ("clear", [0], WeightState.NORMAL)):  # rank 1 hung: cancelled to NORMAL
            with embedded(tc, serving=serving):
                n = store.request_weights(action, f"generate: weights_cancel {action}")
                wait_for(done(n, state), TIMEOUT_S, store, f"{action} {n} over")
                if serving != [0, 1]:
                    wait_for(lambda: store.read_cluster().weights_cancelled == n, TIMEOUT_S, store, "cancelled")
        tc.stop()
        triggers = [a["trigger"] for a in store.iter_audit() if a["key"] == "weights:1"]
        assert triggers == ["clear", "cleared", "update", "cancel_to_cleared", "update", "updated", "clear",
                            "cancel"], triggers
        return export_recording(store, out)


#: heartbeat TTL of the membership scenario's agents (they beat every TTL / 4)
MEMBER_TTL_MS = 400

SCENARIOS = {"happy": happy, "load_failed": load_failed, "takeover": takeover, "gated_skip": gated_skip,
             "stale_rank": stale_rank, "weights": weights, "cordoned_http": cordoned_http,
             "membership": membership, "weights_cancel": weights_cancel}


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
