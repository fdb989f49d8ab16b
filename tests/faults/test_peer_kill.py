"""A peer SIGKILLed mid-transfer, with real worker processes: the ranks it was serving read those experts from the
checkpoint (audited as ``detail.fallback`` on their ``staged`` transitions) and the round goes on once the killed
rank's worker is back."""

from __future__ import annotations

import json

import pytest

from fdeplb.store import Store
from tests.faults.helpers import PEER_EP as EP
from tests.faults.helpers import peer_cluster
from tests.helpers import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.faults]


def _fallbacks_from(store: Store, peer: int) -> list[dict]:
    out = []
    for a in store.iter_audit():
        if a["machine"] == "rank" and a["trigger"] == "staged" and a["detail"]:
            detail = json.loads(a["detail"])
            if any(f["peer"] == peer for f in detail.get("fallback", [])):
                out.append({"key": a["key"], "reason": a["reason"], **detail})
    return out


def test_a_peer_killed_mid_transfer_costs_a_disk_read_and_the_round_goes_on(redis_url, real_data, tmp_path):
    store, cluster, coordinator, thread = peer_cluster(redis_url, real_data, tmp_path, "peerkill", hang_rank=1)
    try:  # rank 1 hangs in the middle of the first expert it sends
        thread.start()
        store.request_round()
        log = tmp_path / "rank1.log"
        wait_for(lambda: log.is_file() and "failpoint hit" in log.read_text(errors="replace"), 60, store,
                 "rank 1 to hang mid-transfer")
        cluster.procs[1].kill()
        cluster.procs[1].wait(timeout=30)
        audited = wait_for(lambda: _fallbacks_from(store, 1), 60, store, "a staged record with a fallback")
        errors = [f["error"] for a in audited for f in a["fallback"] if f["peer"] == 1]
        assert all("did not deliver" in e for e in errors), [e for e in errors if "did not deliver" not in e]
        assert all("did not deliver them" in a["reason"] and "1" in a["reason"] for a in audited)
        cluster.start_rank(1)  # its worker back (--replace): the round rolls on
        wait_for(lambda: store.read_cluster().state == "FREE" and store.read_cluster().round >= 1, 120, store,
                 "the round to end")
        plan_id = store.current_placement().plan_id
        for r in range(EP):  # whatever the round's outcome, every rank verifies the placement it serves
            rec = store.read_rank(r)
            assert rec.live_plan_id == plan_id and rec.slots_verified == rec.slots_total
        for a in audited:  # the experts rank 1 did not send were read from disk
            assert store.read_rank(int(a["key"].rsplit(":", 1)[1])).disk > 0 or plan_id == ""
    finally:
        coordinator.stop_event.set()
        cluster.stop()
        thread.join(10)
        store.delete_cluster()
