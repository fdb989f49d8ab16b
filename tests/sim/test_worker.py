"""The simulated worker's parent watch: a worker whose parent is gone stops, and its log says why."""

from __future__ import annotations

import subprocess
import sys
import threading

import structlog.testing

from fdeplb.sim import worker


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
