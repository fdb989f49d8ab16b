"""Clients that ride out outages as the workers do (issue 34 item 9): ``rearrange --wait`` through a real
redis-server SIGKILLed mid-round and restarted on the same port (its append-only file keeps the records), and
``audit --url ... --follow`` through a real ``fdeplb serve`` restarted on the same port. Each says so once on stderr
per outage, goes on, and exits 7 when the outage outlasts its timeout. The back-off is the workers' rule
(:func:`fdeplb.backoff.redis_backoff_s`): checked here with a clock that only the retries move."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from fdeplb.backoff import REDIS_RETRY_CAP_S, redis_backoff_s, ride_out
from fdeplb.errors import RedisUnavailableError
from fdeplb.machines.tables import WEIGHTS, ClusterState
from fdeplb.orchestration.handles import RecordHandle
from fdeplb.store import Deadlines
from tests.api_helpers import registered_cluster, serve_process
from tests.api_helpers import PASSWORD, USER, free_port, wait_http
from tests.helpers import run_cli, thread_cluster, wait_for
from tests.servers import RedisServer

ROOT = Path(__file__).resolve().parents[2]
UNAVAILABLE = "unavailable, retrying for up to"


class Lines:
    """A subprocess's stdout and stderr read line by line in threads, so a test waits on a line with a deadline."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.out: list[str] = []
        self.err: list[str] = []
        self._new: queue.Queue = queue.Queue()
        self._readers = [threading.Thread(target=self._read, args=(stream, into), daemon=True)
                         for stream, into in ((proc.stdout, self.out), (proc.stderr, self.err))]
        for t in self._readers:
            t.start()

    def _read(self, stream, into: list[str]) -> None:
        for line in stream:
            into.append(line.rstrip("\n"))
            self._new.put(None)
        self._new.put(None)

    def wait(self, text: str, timeout_s: float, where: str = "err") -> str:
        """The first line of stdout (``where="out"``) or stderr holding ``text``; AssertionError after
        ``timeout_s`` or when the process ended without it."""
        lines = self.out if where == "out" else self.err
        end = time.monotonic() + timeout_s
        while True:
            found = next((ln for ln in lines if text in ln), None)
            if found is not None:
                return found
            left = end - time.monotonic()
            if left <= 0 or (self.proc.poll() is not None and not any(t.is_alive() for t in self._readers)):
                raise AssertionError(f"no line with {text!r} on std{where}:\n" + "\n".join(self.out + self.err))
            try:
                self._new.get(timeout=min(left, 1.0))
            except queue.Empty:
                pass

    def stop(self) -> None:
        """SIGKILL the process if it still runs (a failed test leaves nothing behind)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.end(30)

    def end(self, timeout_s: float) -> int:
        rc = self.proc.wait(timeout=timeout_s)
        for t in self._readers:
            t.join(10)
        return rc


@pytest.fixture(autouse=True)
def _children_take_sigint():
    """The CLI processes these tests start get SIGINT (Ctrl-C) as a terminal would deliver it: a suite launched as
    a background job of a non-interactive shell (``cmd &``) runs with SIGINT ignored, which its children inherit
    across exec; a handler is not inherited, so the children start with the default and Python's own handler."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _up(server: RedisServer) -> None:
    """Start ``server`` again on its port unless it runs."""
    if server.proc is None or server.proc.poll() is not None:
        server.start()


def _cli(*args: str) -> Lines:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FDEPLB_API_USER": USER, "FDEPLB_API_PASSWORD": PASSWORD}
    return Lines(subprocess.Popen([sys.executable, "-m", "fdeplb", *args], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE))


def test_ride_out_backs_off_by_the_house_rule_says_it_once_and_gives_up_at_the_bound(monkeypatch):
    clock = {"now": 100.0}
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        clock["now"] += s

    monkeypatch.setattr("fdeplb.backoff.time.monotonic", lambda: clock["now"])
    monkeypatch.setattr("fdeplb.backoff.time.sleep", sleep)
    said: list[str] = []
    failing = {"left": 5}

    def call() -> str:
        if failing["left"]:
            failing["left"] -= 1
            raise RedisUnavailableError("connection refused")
        return "page"

    assert ride_out(call, what="Redis at X", retry_s=60, say=said.append) == "page"
    assert sleeps == [redis_backoff_s(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert said == ["Redis at X unavailable, retrying for up to 60 s (connection refused)",
                    "Redis at X answers again after 15.5 s"]
    sleeps.clear(), said.clear()
    failing["left"] = 10**6  # away for good: tries until 20 s, the last back-off cut to what is left
    with pytest.raises(RedisUnavailableError, match=r"Redis at X did not answer for 20.0 s \(7 tries"):
        ride_out(call, what="Redis at X", retry_s=20, say=said.append)
    assert sleeps == [0.5, 1.0, 2.0, 4.0, 8.0, 4.5] and max(sleeps) <= REDIS_RETRY_CAP_S and len(said) == 1
    with pytest.raises(RedisUnavailableError, match="connection refused"):  # no time left: at once, nothing said
        ride_out(call, what="Redis at X", retry_s=0, say=said.append)
    assert len(said) == 1

    def frozen() -> str:  # a frozen Redis: every try lasts the socket timeout before it fails
        clock["now"] += 30.0
        raise RedisUnavailableError("Timeout reading from socket")

    start = clock["now"]
    with pytest.raises(RedisUnavailableError, match=r"did not answer for 30.0 s \(1 tries"):
        ride_out(frozen, what="Redis at X", retry_s=30, say=said.append)
    assert clock["now"] - start == 30.0  # QA: the bound counted from the first failure: 60 s, twice the bound


def test_retry_timeout_without_follow_is_refused(capsys):
    code, _out, err = run_cli(capsys, "audit", "--url", "http://127.0.0.1:1", "--retry-timeout", "3")
    assert code == 2 and "--retry-timeout bounds how long --follow waits out an outage: it needs --follow" in err


@pytest.mark.slow
@pytest.mark.faults
def test_rearrange_wait_rides_out_redis_killed_and_restarted_mid_round(tmp_path, cluster_id):
    server = RedisServer(tmp_path / "redis")
    deadlines = Deadlines(collecting_ms=120_000, loading_ms=60_000, commit_ms=60_000, swapping_ms=60_000)
    try:
        with thread_cluster(server.url, cluster_id, tmp_path, num_layers=2, num_experts=8, num_redundant=4,
                            deadlines=deadlines) as tc, ExitStack() as stack:
            stack.callback(_up, server)  # before the cluster's clean-up, however the test ends
            store = tc.store()
            tc.start_agents([0, 1, 2])
            tc.start_silent_rank(3)  # up, never publishes its load: the round holds in COLLECTING
            tc.start_coordinator()
            cli = _cli("rearrange", "--redis-url", server.url, "--cluster", cluster_id, "--wait", "--timeout", "150")
            stack.callback(cli.stop)
            cli.wait("will serve this request", 60, "out")
            follower = _cli("audit", "--redis-url", server.url, "--cluster", cluster_id, "--machine", "cluster",
                            "--follow")
            stack.callback(follower.stop)
            follower.wait("FREE -> COLLECTING", 60, "out")  # the round started, the follower has read it
            server.kill()  # SIGKILL mid-round
            for client in (cli, follower):
                client.wait(f"note: Redis at {server.url} {UNAVAILABLE}", 60)
                assert client.proc.poll() is None  # before: exit 7 at once
            _up(server)  # the same port, the records from the append-only file
            tc.start_agent(3, replace=True)  # rank 3's worker publishes its load: the round goes on
            assert cli.end(150) == 0, "\n".join(cli.out + cli.err)
            assert any(ln.startswith("round 1: rearranged") or ln.startswith("round 1: skipped") for ln in cli.out)
            assert store.read_cluster().state is ClusterState.FREE and store.read_cluster().round == 1
            follower.wait(" -> FREE", 60, "out")  # the round's end, committed after the restart
            follower.proc.send_signal(signal.SIGINT)  # Ctrl-C ends --follow
            assert follower.end(30) == 0
            for client in (cli, follower):
                assert sum(UNAVAILABLE in ln for ln in client.err) == 1 and \
                    sum("answers again after" in ln for ln in client.err) == 1, client.err
    finally:
        server.close()


@pytest.mark.slow
@pytest.mark.faults
def test_rearrange_wait_exits_7_when_redis_is_still_away_as_its_timeout_passes(tmp_path, cluster_id):
    server = RedisServer(tmp_path / "redis")
    try:
        with thread_cluster(server.url, cluster_id, tmp_path, num_layers=1, num_experts=8, num_redundant=0,
                            ep_size=2) as tc, ExitStack() as stack:
            stack.callback(_up, server)
            tc.start_coordinator()  # no rank agents: the requested round cannot start
            RecordHandle(tc.store(), WEIGHTS, 0, actor="test").fire("clear")  # a record for the follower to print
            cli = _cli("rearrange", "--redis-url", server.url, "--cluster", cluster_id, "--wait", "--timeout", "6")
            stack.callback(cli.stop)
            follower = _cli("audit", "--redis-url", server.url, "--cluster", cluster_id, "--follow",
                            "--retry-timeout", "2")
            stack.callback(follower.stop)
            cli.wait("will serve this request", 60, "out")
            wait_for(lambda: follower.out or follower.proc.poll() is not None, 60, None, "the audit so far")
            server.kill()
            cli.wait(UNAVAILABLE, 30)
            assert cli.end(60) == 7
            last = cli.err[-1]
            assert last.startswith(f"error: Redis at {server.url} did not answer for ") and \
                "--timeout 6s passed before round 1 was seen to end, it may still finish: fdeplb status" in last, last
            assert follower.end(60) == 7 and sum(UNAVAILABLE in ln for ln in follower.err) == 1
            assert follower.err[-1].startswith(f"error: Redis at {server.url} did not answer for "), follower.err
    finally:
        server.close()


@pytest.mark.slow
def test_audit_follow_over_http_rides_out_a_serve_restart(redis_url, cluster_id):
    store, _ = registered_cluster(redis_url, cluster_id)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = serve_process(redis_url, cluster_id, port)
    clis: list[Lines] = []
    try:
        wait_http(url, proc=serve)
        for trigger in ("clear", "cleared"):  # records to print first: the follower is reading once they are out
            RecordHandle(store, WEIGHTS, 1, actor="test").fire(trigger)
        before = store.audit_length()
        assert before >= 2
        cli = _cli("audit", "--url", url, "--follow", "--limit", str(before + 2))
        clis.append(cli)
        wait_for(lambda: len(cli.out) == before or cli.proc.poll() is not None, 60, None, "the records so far")
        serve.send_signal(signal.SIGTERM)  # a restart: the open long poll is answered, the next finds no server
        serve.communicate(timeout=30)
        cli.wait(f"note: the API at {url} {UNAVAILABLE} 300 s", 60)
        serve = serve_process(redis_url, cluster_id, port)
        wait_http(url, proc=serve)
        handle = RecordHandle(store, WEIGHTS, 0, actor="test")
        for trigger in ("clear", "cleared"):  # two new audit records: the follower prints them and stops (--limit)
            handle.fire(trigger)
        assert cli.end(60) == 0, "\n".join(cli.out + cli.err)
        assert len(cli.out) == before + 2 and "weights:0" in cli.out[-1] and "weights:0" in cli.out[-2]
        assert sum(UNAVAILABLE in ln for ln in cli.err) == 1 and \
            sum("answers again after" in ln for ln in cli.err) == 1, cli.err
        # an outage longer than --retry-timeout ends the follower with exit 7, naming the server
        cli = _cli("audit", "--url", url, "--follow", "--retry-timeout", "2")
        clis.append(cli)
        wait_for(lambda: len(cli.out) >= before + 2 or cli.proc.poll() is not None, 60, None, "the records so far")
        serve.send_signal(signal.SIGTERM)
        serve.communicate(timeout=30)
        assert cli.end(60) == 7
        assert cli.err[-1].startswith(f"error: the API at {url} did not answer for "), cli.err
    finally:
        for cli in clis:
            cli.stop()
        if serve.poll() is None:
            serve.terminate()
            serve.communicate(timeout=30)
        store.delete_cluster()


def test_rearrange_wait_on_a_frozen_redis_ends_near_its_timeout_not_30_s_past_it(cluster_id):
    """QA: with Redis frozen (SIGSTOP: connections accepted, nothing answered) `rearrange --wait --timeout 1` took
    the store's 30 s socket timeout per read; each read of the wait now awaits a quarter of the wait at most (3 s
    at least). A socket that accepts and never answers stands for the frozen Redis."""
    import socket

    from fdeplb.cli.operate import wait_for_round
    from fdeplb.store import Store
    from tests.helpers import within

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    try:
        store = Store(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", cluster_id)
        with pytest.raises(RedisUnavailableError, match="did not answer in time.*--timeout 1s passed"):
            within(lambda: wait_for_round(store, 1, "0-0", 1.0, store_url=store.url), 20.0)  # 30 s: it blocked
    finally:
        silent.close()


def test_an_http_post_whose_answer_never_came_says_it_may_have_been_applied(monkeypatch):
    """QA: `fdeplb trigger --url` against a frozen `serve` said only "no answer ... ReadTimeout", although the
    request had been sent (a round may have been requested); a GET says no more than before."""
    import socket

    from fdeplb.cli.http_client import ApiClient

    monkeypatch.setenv("FDEPLB_API_USER", USER)
    monkeypatch.setenv("FDEPLB_API_PASSWORD", PASSWORD)
    silent = socket.socket()  # accepts connections and never answers (a SIGSTOPped serve)
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    try:
        client = ApiClient(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.5)
        with pytest.raises(RedisUnavailableError, match="ReadTimeout: the POST /rearrange_experts was sent and may "
                                                        "have been applied; look"):
            client.post("/rearrange_experts", {"ips": []})
        with pytest.raises(RedisUnavailableError, match="ReadTimeout$"):
            client.get("/v1/state")
    finally:
        silent.close()
