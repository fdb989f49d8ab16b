"""EmbeddedAgent.close() while its loop is busy (QA of the serving hot path, item 2): a bounded wait, then the loop
is abandoned, never under a closed store; nothing raised leaves its thread; a log line says so. A thread cluster
with one agent and no coordinator: the loop's step is held on an event, as a long staging holds it."""

from __future__ import annotations

import threading

import pytest
import structlog.testing

from fdeplb.orchestration.embedded_agent import EmbeddedAgent
from fdeplb.testing import NumpyWeights
from tests.helpers import thread_cluster

pytestmark = pytest.mark.slow  # a thread cluster


def test_close_abandons_a_busy_loop_which_closes_the_store_itself_and_leaks_nothing(redis_url, cluster_id,
                                                                                    tmp_path, monkeypatch):
    uncaught: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: uncaught.append(args.exc_value))
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        agent = EmbeddedAgent(store, 0, backend_factory=NumpyWeights.factory(), publish_interval_s=None)
        busy, release = threading.Event(), threading.Event()
        step = agent.step
        closes: list[bool] = []  # at each close of the store: is the loop's thread still running?
        store_close = store.close

        def held_step(*a, **k):
            busy.set()
            assert release.wait(30), "never released"
            store.read_cluster()  # the step goes on with the store after close() returned
            return step(*a, **k)

        def spy_close():
            closes.append(agent._thread.is_alive() and threading.current_thread() is not agent._thread)
            store_close()

        def failing_stop(*_a):
            raise RuntimeError("a bug on the way out")  # not an FdeplbError: run() lets it out

        monkeypatch.setattr(agent, "step", held_step)
        monkeypatch.setattr(store, "close", spy_close)
        monkeypatch.setattr(store, "mark_rank_stopped", failing_stop)
        agent.start()
        assert busy.wait(30)
        with structlog.testing.capture_logs() as logs:
            agent.close(timeout_s=0.05)
            assert agent.abandoned and agent._thread.is_alive()
            assert closes == []  # not closed under the busy loop
            assert [e for e in logs if e["log_level"] == "warning" and "abandoned" in e["event"]]
            release.set()
            agent._thread.join(30)
        assert not agent._thread.is_alive()
        assert closes == [False]  # closed once, by the loop as it ended
        assert [e for e in logs if e["event"] == "agent loop failed" and "a bug on the way out" in e["error"]]
        assert [e for e in logs if e["event"] == "abandoned agent loop ended: store closed"]
    assert uncaught == []


def test_close_of_an_idle_agent_waits_for_the_loop_then_closes_the_store(redis_url, cluster_id, tmp_path,
                                                                         monkeypatch):
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        store = tc.store()
        agent = EmbeddedAgent(store, 0, backend_factory=NumpyWeights.factory(), publish_interval_s=None)
        closes: list[bool] = []
        store_close = store.close
        monkeypatch.setattr(store, "close", lambda: (closes.append(agent._thread.is_alive()), store_close()))
        agent.start()
        agent.close(timeout_s=30)
        assert not agent.abandoned and closes == [False]


def test_no_busy_heartbeat_once_the_agent_is_stopping(redis_url, cluster_id, tmp_path, monkeypatch):
    """The staging's heartbeat (a thread of its own) stops beating when close() sets the stop event: an abandoned
    staging does not keep the closed agent's rank alive."""
    with thread_cluster(redis_url, cluster_id, tmp_path) as tc:
        agent = EmbeddedAgent(tc.store(), 0, backend_factory=NumpyWeights.factory(), publish_interval_s=None)
        beats: list[bool] = []
        monkeypatch.setattr(agent, "_heartbeat", lambda **k: beats.append(True))
        agent._busy_beat()
        agent.stop_event.set()
        agent._busy_beat()
        assert beats == [True]
