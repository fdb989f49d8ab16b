"""The store's optimistic transactions have one bound (:mod:`fdeplb.store.txn`), and a configuration change commits
with its audit note in one step (:meth:`Store.change_config`)."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
import redis

import fdeplb
from fdeplb.errors import ContentionError, StoreError, exit_code, http_status
from fdeplb.store.txn import TXN_ATTEMPTS, transaction
from tests.helpers import RawRedis

#: how long a test thread waits for the other side of a handshake before the test fails (a deadline, not a pace)
_HANDSHAKE_S = 10.0


class Bumper:
    """A second client, in a thread, that changes ``key`` once each time the transaction under test has read it
    (``ran``) while the first ``bumps`` attempts last, then lets the transaction go on (``bumped``)."""

    def __init__(self, url: str, key: str, bumps: int) -> None:
        self.client = redis.Redis.from_url(url)
        self.key, self.bumps = key, bumps
        self.ran, self.bumped, self.stop = threading.Event(), threading.Event(), threading.Event()
        self.attempts = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.ran.wait(_HANDSHAKE_S):
                return
            self.ran.clear()
            self.client.incr(self.key)
            self.bumped.set()

    def between_read_and_exec(self) -> None:
        """Called by the transaction's function after its reads: the key changes now while bumps are left."""
        self.attempts += 1
        if self.attempts > self.bumps:
            return
        self.ran.set()
        assert self.bumped.wait(_HANDSHAKE_S), "the bumping client did not answer"
        self.bumped.clear()

    def __enter__(self) -> "Bumper":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.ran.set()
        self.thread.join(_HANDSHAKE_S)
        self.client.delete(self.key)


def _txn(bumper: Bumper, key: str, target: str):
    def txn(pipe) -> str:
        seen = pipe.get(key)
        bumper.between_read_and_exec()
        pipe.multi()
        pipe.set(target, b"written after " + (seen or b"0"))
        return "committed"

    return txn


def test_a_writer_changing_the_watched_key_every_attempt_gets_a_contention_error_and_nothing_is_written(
        redis_url, cluster_id):
    client = redis.Redis.from_url(redis_url)
    key, target = f"txn-test:{cluster_id}:watched", f"txn-test:{cluster_id}:target"
    with Bumper(redis_url, key, bumps=TXN_ATTEMPTS + 5) as bumper:
        with pytest.raises(ContentionError, match=f"after {TXN_ATTEMPTS} attempts.*{re.escape(key)}.*nothing"):
            transaction(client, _txn(bumper, key, target), key, value_from_callable=True)
        assert bumper.attempts == TXN_ATTEMPTS  # gave up at the bound, not before, not after
        assert int(client.get(key)) == TXN_ATTEMPTS  # every attempt lost to a change of the watched key
    assert not client.exists(target)


def test_one_contended_attempt_is_retried_and_commits(redis_url, cluster_id):
    client = redis.Redis.from_url(redis_url)
    key, target = f"txn-test:{cluster_id}:watched", f"txn-test:{cluster_id}:target"
    with Bumper(redis_url, key, bumps=1) as bumper:
        assert transaction(client, _txn(bumper, key, target), key, value_from_callable=True) == "committed"
        assert bumper.attempts == 2
        assert client.get(target) == b"written after 1"  # the retry read the writer's change
        assert transaction(client, _txn(bumper, key, target), key) == [True]  # EXEC's replies by default
    client.delete(target)


def test_contention_error_is_a_stale_state_conflict_for_the_api_and_the_cli():
    err = ContentionError("x")
    assert (http_status(err), exit_code(err)) == (409, 3)


def test_every_optimistic_transaction_goes_through_the_bounded_one():
    root = Path(fdeplb.__file__).parent
    direct = [f"{p.relative_to(root)}:{n}" for p in sorted(root.rglob("*.py")) if p.name != "txn.py"
              for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\.transaction\(", line)]
    assert direct == []  # redis-py's own transaction() retries without end


def test_a_store_transaction_under_endless_contention_raises_and_changes_nothing(fired, redis_url):
    store = fired  # a one-rank cluster after a round: an audit chain to extend
    raw = RawRedis(redis_url, store.cluster)
    config, audit = raw.r.hgetall(raw.keys.config), raw.audit_len()
    bumps = []

    def bump(_new_config) -> None:  # change_config's check runs between its reads and EXEC: another writer moves
        bumps.append(raw.r.hincrby(raw.keys.rearrange, "clear_stat_request", 1))  # the WATCHed cluster record

    with pytest.raises(ContentionError, match=f"after {TXN_ATTEMPTS} attempts"):
        store.change_config({"min_gain": 0.05}, actor="test", check=bump)
    assert bumps == list(range(1, TXN_ATTEMPTS + 1))
    assert raw.r.hgetall(raw.keys.config) == config and raw.audit_len() == audit
    assert store.read_config(fresh=True).min_gain == 0.0


def test_a_config_change_whose_audit_record_cannot_be_appended_changes_nothing(fired, redis_url):
    store = fired
    raw = RawRedis(redis_url, store.cluster)
    config, head = raw.r.hgetall(raw.keys.config), raw.r.get(raw.keys.audit_head)
    saved = raw.r.dump(raw.keys.audit)
    raw.r.delete(raw.keys.audit)
    raw.r.set(raw.keys.audit, "not a stream")  # the append (XADD) inside the commit fails with WRONGTYPE
    try:
        with pytest.raises(StoreError, match="WRONGTYPE"):
            store.change_config({"min_gain": 0.05}, actor="test", reason="r")
        assert raw.r.hgetall(raw.keys.config) == config  # no configuration change without its audit record
        assert raw.r.get(raw.keys.audit_head) == head
    finally:
        raw.r.delete(raw.keys.audit)
        raw.r.restore(raw.keys.audit, 0, saved)
    assert store.read_config(fresh=True).version == 0


def test_a_config_change_and_its_note_land_together_on_the_chain(fired, redis_url):
    store = fired
    raw = RawRedis(redis_url, store.cluster)
    rec = store.read_cluster()
    old, new, audit_id = store.change_config({"min_gain": 0.05}, actor="test", reason="why")
    note = store.audit()[-1]
    assert note.id == audit_id and (old.version, new.version) == (0, 1)
    assert (note["trigger"], note["actor"], note["version"], note["from"]) == \
        ("config_changed", "test", str(rec.version), rec.state.value)
    assert json.loads(note["detail"]) == {"changes": {"min_gain": [0.0, 0.05]}, "version": 1, "by": "test"}
    assert note["reason"] == "config changed: min_gain 0.0 -> 0.05 (why)"
    assert raw.r.get(raw.keys.audit_head).decode() == note["chain"]
    assert json.loads(raw.r.hget(raw.keys.config, "version")) == 1
    assert store.change_config({"min_gain": 0.05}, actor="test")[2] == ""  # nothing differs: no note
    assert store.audit()[-1].id == audit_id
