"""QA finding: a *deleted* member record (``DEL fdeplb:{c}:member:R``) of an EXCLUDED rank is read as the initial
ACTIVE v0: the rank is silently a member again, with no audit record, although the audit's last membership record
of the rank says EXCLUDED. Expected (issue 34 item 4: the last audited state is the record's truth): the record is
restored from the audit (or the rank excluded), audited, and the rank is not counted a member meanwhile."""

from __future__ import annotations

import pytest
import redis

from fdeplb.machines.tables import MEMBERSHIP, MemberState
from tests.helpers import wait_for
from tests.orchestration.helpers import lose_rank3

pytestmark = pytest.mark.slow  # a thread cluster

M = MemberState


def test_a_deleted_member_record_of_an_excluded_rank_does_not_readmit_it_unaudited(redis_url, cluster_id, tmp_path):
    with lose_rank3(redis_url, cluster_id, tmp_path) as (tc, store):
        raw = redis.Redis.from_url(redis_url)
        audited = [a for a in store.iter_audit() if a["key"] == "member:3"]
        raw.delete(f"fdeplb:{{{cluster_id}}}:member:3")
        # the leading coordinator's watch passes several times within this deadline (as for a corrupt record)
        notes = wait_for(lambda: [a for a in store.iter_audit() if a["key"] == "member:3"][len(audited):] or None,
                         15, store, "an audited repair of the deleted member:3")
        assert store.read(MEMBERSHIP, 3).state is M.EXCLUDED, notes
        tc.stop()
