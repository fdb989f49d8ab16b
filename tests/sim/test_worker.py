"""The simulated worker: its parent watch (a worker whose parent is gone stops, and its log says why); argument
errors as one line and an exit code; a wrong trace or a live agent refused before registering; signals while paddle
is imported."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest
import structlog.testing

from fdeplb.sim import worker
from tests.helpers import wait_for
from tests.sim.helpers import one_line_error, two_rank_cluster, worker_process, write_trace


def test_a_worker_whose_parent_is_gone_stops_and_logs_why():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    stop = threading.Event()
    worker._exited.set()  # the agent has "exited": watch_parent must not os._exit this test process
    try:
        with structlog.testing.capture_logs() as logs:
            watcher = threading.Thread(target=worker.watch_parent, args=(gone.pid, stop), kwargs={"period_s": 0.01})
            watcher.start()
            watcher.join(timeout=30)
    finally:
        worker._exited.clear()
    assert not watcher.is_alive() and stop.is_set()
    warnings = [e for e in logs if e["event"] == "parent process gone: stopping"]
    assert [(e["log_level"], e["parent_pid"]) for e in warnings] == [("warning", gone.pid)], logs


# ---- argument errors, a wrong trace, a live agent, signals during the paddle import ---------------------
def test_worker_argument_errors_are_one_line_and_their_exit_code(redis_url, cluster_id, tmp_path):
    store = two_rank_cluster(redis_url, cluster_id)
    trace = write_trace(tmp_path, 2, 8)
    try:
        err = one_line_error(worker_process(redis_url, cluster_id, "--rank", "99", trace=trace), 2)
        assert "--rank 99 is outside" in err and "0..1" in err
        assert "not initialised" in one_line_error(worker_process(redis_url, "no-such-cluster", "--rank", "0",
                                                            trace=trace), 2)
        assert "did not answer within 0.2 s" in one_line_error(worker_process("redis://127.0.0.1:1/0", cluster_id,
                                                                        "--rank", "0", trace=trace), 7)
        # a trace of another model: refused before the worker registers (a 4 x 16 trace against a 2 x 8 cluster)
        err = one_line_error(worker_process(redis_url, cluster_id, "--rank", "0", trace=write_trace(tmp_path, 4, 16)), 2)
        assert "4 layers x 16 experts" in err and "2 x 8" in err
        assert store.rank_info() == {}
    finally:
        store.delete_cluster()


def test_a_live_agent_is_superseded_only_with_replace(redis_url, cluster_id, tmp_path):
    store = two_rank_cluster(redis_url, cluster_id)
    store.register_rank(0, {"agent_id": "healthy", "actor": "rank0@1"})
    store.heartbeat(0, heartbeat_ttl_ms=600_000)
    trace = write_trace(tmp_path, 2, 8)
    try:
        err = one_line_error(worker_process(redis_url, cluster_id, "--rank", "0", trace=trace), 3)
        assert "driven by a live agent (rank0@1, agent healthy" in err and "--replace" in err
        assert store.rank_agent(0) == "healthy"
        proc = worker_process(redis_url, cluster_id, "--rank", "0", "--replace", trace=trace)
        try:
            wait_for(lambda: store.rank_agent(0) not in (None, "healthy") or proc.poll() is not None, 120, store,
                     "the --replace worker registered")
            assert proc.poll() is None, proc.communicate()
        finally:
            proc.terminate()
            proc.communicate(timeout=60)
        assert proc.returncode == 0
    finally:
        store.delete_cluster()


@pytest.mark.slow
def test_sigterm_while_paddle_is_imported_stops_the_worker_cleanly(redis_url, cluster_id, tmp_path):
    """The worker SIGSTOPs itself right after importing paddle (failpoint ``worker.stop``), still inside the window
    where paddle's own handler would get the signal; a SIGTERM then, and SIGCONT: our handler stops it, exit 0."""
    import psutil

    pytest.importorskip("paddle")
    store = two_rank_cluster(redis_url, cluster_id)
    proc = worker_process(redis_url, cluster_id, "--rank", "0", backend="paddle", trace=write_trace(tmp_path, 2, 8),
                   env={"FDEPLB_FAILPOINTS": "worker.stop=imported"})
    try:
        ps = psutil.Process(proc.pid)
        wait_for(lambda: ps.status() == psutil.STATUS_STOPPED or proc.poll() is not None, 120, None,
                 "the worker stopped at its failpoint")
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, (proc.returncode, out, err)
        assert store.rank_info() == {}  # it stopped before it registered
    finally:
        if proc.poll() is None:
            proc.kill()
        store.delete_cluster()
