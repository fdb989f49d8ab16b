"""A swap checked by its output, end to end (issue 31 item 5): EmbeddedAgents on paddle tensors (CPU) with an
output probe registered; rank 1 exchanges two of its slots' bytes right after its verified chunk (the same
multiset, the wrong layout: every checksum passes). The probe catches it: the round's ``swapped`` is audited as a
``probe_mismatch`` naming the layer and the ranks, ``/health`` is 503, and the coordinator goes back to the
previous placement in a rollback round, after which the probe agrees and ``/health`` is 200 again. The recording of
it all replays."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

pytest.importorskip("paddle")

from fdeplb.api import service  # noqa: E402
from fdeplb.machines.tables import RankState  # noqa: E402
from fdeplb.orchestration import rollback  # noqa: E402
from fdeplb.recording import export_recording  # noqa: E402
from fdeplb.replay.verify import check_recording  # noqa: E402
from fdeplb.status import cluster_status  # noqa: E402
from fdeplb.ui.view_model import timeline  # noqa: E402
from fdeplb.weights import _paddle  # noqa: E402
from fdeplb.weights.live import LiveExperts  # noqa: E402
from tests.helpers import wait_for  # noqa: E402
from tests.orchestration.helpers import new_load, paddle_serving, round_done  # noqa: E402

L, TOKENS, UP, DOWN = 4, 8, "up_gate_proj.weight", "down_proj.weight"


class ClusterProbe:
    """The probe of a toy EP engine whose ranks are threads of this process: rank r's probe runs a fixed batch of
    its own tokens through every MoE layer, every token to every logical expert (token t to the expert's replica
    t mod logcnt, so every slot is exercised), reading the owners' live slots. All ranks probe together (a barrier
    on both sides, as a collective would): nobody changes a slot while one reads it. Bit-exact whatever the
    placement: each slot's FFN sees the whole batch, and the experts are summed in logical order."""

    def __init__(self, agents):
        self.agents = agents
        self.barrier = threading.Barrier(len(agents))
        self.calls = [0] * len(agents)

    def of(self, r):
        x = np.random.default_rng([7, r]).standard_normal((TOKENS, 8)).astype(np.float32)

        def probe():
            self.calls[r] += 1
            self.barrier.wait(timeout=60)
            try:
                return {layer: self._layer(r, layer, x) for layer in range(L)}
            finally:
                self.barrier.wait(timeout=60)

        return probe

    def _layer(self, r, layer, x):
        live = self.agents[r].backend.live
        log2phy, logcnt = live.log2phy.numpy()[layer], live.logcnt.numpy()[layer]
        spr = live.slots_per_rank
        gate = np.random.default_rng([11, layer]).random((TOKENS, log2phy.shape[0])).astype(np.float32)
        out = np.zeros((TOKENS, x.shape[1]), np.float32)
        for e in range(log2phy.shape[0]):
            slots = log2phy[e, np.arange(TOKENS) % logcnt[e]]
            y = np.empty_like(out)
            for s in np.unique(slots):
                owner = self.agents[int(s) // spr].backend.live
                w = {k: owner.tensors[k][layer].numpy()[int(s) % spr] for k in (UP, DOWN)}
                h = x @ w[UP]
                g, u = np.split(h, 2, axis=-1)
                y[slots == s] = ((g / (1 + np.exp(-g)) * u) @ w[DOWN])[slots == s]
            out += gate[:, e:e + 1] * y
        return out


def _with_probe(box):
    """A ``setup`` for :func:`paddle_serving`: every agent gets the cluster probe (kept in ``box``)."""
    def setup(agents):
        box["probe"] = ClusterProbe(agents)
        for r, a in enumerate(agents):
            a.set_probe(box["probe"].of(r))
    return setup


def _metrics(store):
    """One Prometheus scrape of the cluster, as text."""
    from prometheus_client import CollectorRegistry, generate_latest

    from fdeplb.api.prometheus import ClusterCollector

    registry = CollectorRegistry()
    registry.register(ClusterCollector(store))
    return generate_latest(registry).decode()


def _swapped(store, round_):
    """Round ``round_``'s cluster ``swapped`` audit record's fields, or None."""
    return next((a.fields for a in store.audit() if a["trigger"] == "swapped" and a["machine"] == "cluster"
                 and a["round"] == str(round_)), None)


def test_a_wrong_layout_behind_the_checksums_is_caught_by_the_probe_and_rolled_back(redis_url, cluster_id, tmp_path,
                                                                                    monkeypatch):
    real = LiveExperts.swap_layers
    scrambled: dict = {}

    def swap_then_exchange(self, plan, staged, new, layers):
        """Rank 1, first swap only: after the verified chunk, exchange two of its slots that the swap rewrote with
        different experts (both are rewritten again by a rollback)."""
        old = self.phy2log
        report = real(self, plan, staged, new, layers)
        if self.ep_rank == 1 and not scrambled:
            base, spr = self.ep_rank * self.slots_per_rank, self.slots_per_rank
            for layer in layers:
                changed = [s for s in range(spr) if new[layer, base + s] != old[layer, base + s]]
                pair = next(((i, j) for i in changed for j in changed if i < j
                             and new[layer, base + i] != new[layer, base + j]), None)
                if pair is None:
                    continue
                i, j = pair
                for suffix in self.tensors:
                    a, b = (_paddle.clone(self.slot(layer, s)[suffix]) for s in (i, j))
                    _paddle.copy_into(self.slot(layer, i)[suffix], b)
                    _paddle.copy_into(self.slot(layer, j)[suffix], a)
                scrambled.update(layer=layer, slots=(base + i, base + j))
                break
        return report

    gate = threading.Event()
    real_request = rollback.request_supplied
    monkeypatch.setattr(LiveExperts, "swap_layers", swap_then_exchange)
    # the rollback is requested at once; held here until the test has seen /health 503 between the two rounds
    monkeypatch.setattr(rollback, "request_supplied", lambda store: gate.is_set() and real_request(store))
    box: dict = {}  # only the written slots verified after a swap: the checksums a wrong layout passes
    with paddle_serving(redis_url, cluster_id, tmp_path, _with_probe(box), verify_all=False) as (tc, store, agents):
        probe = box["probe"]
        before = store.current_placement()
        new_load(tc, 1, store)
        store.request_round("test probe")
        swapped = wait_for(lambda: _swapped(store, 1), 90, store, "round 1 swapped")
        assert scrambled, "round 1 changed no two slots of rank 1 in one layer: nothing was exchanged"
        layer = scrambled["layer"]
        detail = json.loads(swapped["detail"])["probe_mismatch"]
        assert swapped["reason"].startswith("probe_mismatch: "), swapped
        assert 1 in [i["ep_rank"] for i in detail], detail
        assert all(i["layers"] == [layer] and i["outcome"] == "mismatch" for i in detail), detail
        wait_for(lambda: round_done(store, 1) and store.supplied_placement() is not None, 30, store,
                 "round 1 released with its rollback supplied")
        rank1 = store.read_rank(1)
        assert (rank1.probe, rank1.probe_layers) == ("mismatch", str(layer)), rank1
        assert rank1.reason.startswith(f"probe mismatch after the swap: layer {layer}: ")
        assert rank1.probe_before_ms > 0 and rank1.probe_after_ms > 0
        status, body = service.health(store)
        assert status == 503 and "probe" in body["msg"] and f"rank 1 layers [{layer}]" in body["probe_mismatch"]
        assert service.probe_health(store) == (503, {"code": 1, "msg": service.HEALTH_PHRASES["probe"]})
        shown = cluster_status(store)
        assert shown["rearrange"]["probe_mismatch"] == body["probe_mismatch"] and shown["ranks"][1]["probe"] == "mismatch"
        assert 'fdeplb_swap_probe_failed{ep_rank="1"} 1.0' in _metrics(store)
        records = [{"id": a.id, **a.fields} for a in store.audit()]
        marks = timeline(records, tc.config, store.now_ms())["rounds"][-1]["marks"]
        assert [m["kind"] for m in marks] == ["probe_mismatch"], marks  # the web view's round 1
        round1 = store.read_plan(store.current_placement().plan_id)
        assert np.array_equal(round1.old_phy2log, before.phy2log)

        gate.set()  # the rollback round: back to the placement round 1 replaced, checked by the probe again
        wait_for(lambda: round_done(store, 2), 90, store, "the rollback round")
        load = next(a.fields for a in store.audit() if a["trigger"] == "load" and a["round"] == "2")
        assert json.loads(load["detail"])["supplied"] == {"kind": "rollback", "undoes": 1,
                                                          "plan_id": before.plan_id, "why": "probe_mismatch"}
        assert load["reason"].startswith("rollback: round 1 undone")
        after = store.current_placement()
        assert np.array_equal(after.phy2log, before.phy2log) and after.plan_id != before.plan_id
        assert _swapped(store, 2)["reason"] == ""
        wait_for(lambda: all(store.read_rank(r).state is RankState.IDLE for r in range(4)), 30, store, "ranks IDLE")
        assert [store.read_rank(r).probe for r in range(4)] == ["agree"] * 4
        assert service.health(store)[0] == 200 and store.read_cluster().probe_mismatch == ""
        assert 'fdeplb_swap_probe_failed{ep_rank="1"} 0.0' in _metrics(store)
        assert store.supplied_placement() is None
        assert all(n >= 4 for n in probe.calls), probe.calls  # before and after, both rounds, every rank
        export_recording(store, tmp_path / "audit.jsonl")
    report = check_recording(tmp_path / "audit.jsonl")  # the replay accepts the probe_mismatch and the rollback
    assert after.plan_id in report.plans_checked, report.plans_checked
