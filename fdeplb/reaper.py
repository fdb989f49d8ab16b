"""Clean-up that outlives its parent: child processes and temporary directories are removed even after ``kill -9``.

A :class:`Reaper` is a small helper process (``python -m fdeplb.reaper``) holding the read end of a pipe whose write
end only its parent holds. The parent tells it, one line at a time, which processes (pid + start time, so a reused
pid is never signalled) and directories it owns. When the pipe reaches end-of-file (the parent closed it, exited or
was killed by any signal, SIGKILL included), the reaper sends SIGTERM to every registered process still alive, waits
up to ``grace_s`` seconds, sends SIGKILL to what is left, runs every registered command (each within
``COMMAND_TIMEOUT_S``; ``fdeplb demo --redis-url`` registers ``fdeplb cluster delete``: an external Redis keeps
nothing of a demo), removes every registered directory and exits. It imports no other fdeplb module. It runs in its
own session and ignores SIGINT/SIGTERM/SIGHUP, so a Ctrl-C or ``timeout`` aimed at the parent does not stop it before
it has cleaned up. A parent that cleans up itself just closes the pipe; the reaper then finds nothing to do.

Linux's ``PR_SET_PDEATHSIG`` was not used: it fires when the *thread* that started a child exits, not the process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["COMMAND_TIMEOUT_S", "Reaper"]

#: seconds a registered command may run before the reaper kills it and carries on
COMMAND_TIMEOUT_S = 30.0


class Reaper:
    """Handle on a reaper process; :meth:`shared` gives the one of this process (started on first use)."""

    _shared: "Reaper | None" = None
    _lock = threading.Lock()

    def __init__(self, grace_s: float = 2.0) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "fdeplb.reaper", str(grace_s)], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        self._io = threading.Lock()
        self._owner = os.getpid()

    @classmethod
    def shared(cls) -> "Reaper":
        """This process's reaper (one per process; a forked child starts its own)."""
        with cls._lock:
            r = cls._shared
            if r is None or r._owner != os.getpid() or r._proc.poll() is not None:
                r = cls._shared = cls()
            return r

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _send(self, line: str) -> None:
        with self._io:
            try:
                self._proc.stdin.write((line + "\n").encode())
                self._proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass  # the reaper is gone: nothing outlives us either way

    def watch_pid(self, pid: int) -> None:
        """Terminate process ``pid`` (if it is still the same process) once this process is gone."""
        self._send(f"pid {pid}")

    def watch_dir(self, path: str | os.PathLike) -> None:
        """Remove directory ``path`` once this process is gone."""
        self._send(f"dir {os.fspath(path)}")

    def watch_command(self, argv: list[str]) -> None:
        """Run ``argv`` (no shell; output discarded; killed after :data:`COMMAND_TIMEOUT_S`) once this process is
        gone, after its processes are stopped (so none undoes what the command does). :class:`ValueError` for an
        empty ``argv`` or one that is not all strings."""
        if not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError(f"watch_command needs a non-empty list of strings, got {argv!r}")
        self._send(f"cmd {json.dumps(list(argv))}")

    def close(self) -> None:
        """Close the pipe now: the reaper cleans up whatever is left and exits."""
        with self._io:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - it ignores nothing but SIGKILL
            self._proc.kill()


def _reap(grace_s: float) -> None:
    import psutil

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    procs: list = []
    dirs: list[str] = []
    commands: list[list[str]] = []
    for raw in sys.stdin.buffer:  # until EOF: the parent closed the pipe or died
        kind, _, arg = raw.decode(errors="replace").strip().partition(" ")
        if kind == "pid":
            try:
                procs.append(psutil.Process(int(arg)))  # remembers the start time: a reused pid is not ours
            except (psutil.Error, ValueError):
                pass
        elif kind == "dir" and arg:
            dirs.append(arg)
        elif kind == "cmd":
            try:
                commands.append([str(a) for a in json.loads(arg)])
            except (ValueError, TypeError):
                pass
    alive = [p for p in procs if p.is_running()]
    for p in alive:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(alive, timeout=grace_s)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=5)
    for argv in commands:
        try:
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=COMMAND_TIMEOUT_S, check=False)
        except (OSError, subprocess.SubprocessError):  # not runnable, or past its deadline: nothing more to do
            pass
    deadline = time.monotonic() + 5
    for d in dirs:
        while Path(d).exists() and time.monotonic() < deadline:  # a dying process may still write into it
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    _reap(float(sys.argv[1]) if len(sys.argv) > 1 else 2.0)
