"""The audit export file: where the coordinator appends audit records before it trims them (``audit_keep``), and
the one rule of which files that may be.

The path is an operator's decision made on the command line (``init-cluster`` / ``config set --audit-export``),
never over the API, and it is confined to the directory the operator names when starting the processes that check
or write it (``--audit-dir``): a path outside that directory (``..`` and symbolic links resolved) is refused, and
with no directory every path is refused (exporting, and so trimming, is then off). The directory itself may not let
the export reach the system's files (QA MED 1): it is refused when it resolves to ``/``, to a directory holding one of
:data:`SYSTEM_DIRS`, or to one inside them (``--audit-dir /`` or ``/etc``); ``/var/log/...``, ``/srv/...``, a home or
a temporary folder are fine. The file itself must be a
regular file: its last component is opened with ``O_NOFOLLOW`` (a symbolic link is refused, wherever it points),
without blocking (a FIFO with no reader is refused, not waited on), created with ``O_CREAT | O_EXCL`` when missing,
and checked with ``fstat`` (no device, FIFO or directory, and one name only: a hard link, which someone who may write
in the directory could plant to a file outside it on the same filesystem, is refused wherever its other names are).

Every refusal is an :class:`~fdeplb.errors.InputError` (HTTP 400, exit 2) naming the path and why; a refused check
creates and writes nothing.

An export that failed partway (a write error, a failed fsync, a trim that never ran) is retried by the next round's
end, with whatever records it then trims: :func:`append_lines` resumes after the last stream id the file holds, so
each record is in the file once, in order.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import time
from typing import Callable, Iterator, Sequence, TextIO

from fdeplb.errors import InputError
from fdeplb.store.streams import parse_stream_id

__all__ = ["SYSTEM_DIRS", "append_lines", "check_audit_dir", "check_export_path", "check_trimming",
           "confine_export_path", "open_export"]

#: the system's directories an audit directory may not be, lie in, or hold (``/`` holds them all): an export there
#: could append to the system's files
SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/sbin", "/sys", "/usr")

#: longest export path accepted (as Linux's PATH_MAX)
MAX_PATH = 4096
_APPEND = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # read: where to resume
#: bytes read at a time walking back from the export's end to its last line
_TAIL_BLOCK = 1 << 16
#: records :func:`append_lines` looks back over, past others' records, for the newest of the writer's own
MAX_RESUME_SCAN = 100_000


def confine_export_path(path: str, audit_dir: str | None) -> str:
    """The absolute form of export ``path`` (its folder resolved: ``..`` and symbolic links; its last component
    kept as given, so a symbolic link there is still seen, and refused, when it is opened), checked to lie inside
    ``audit_dir`` (resolved likewise). A relative ``path`` is relative to the working directory.

    Raises :class:`InputError` when ``audit_dir`` is None or empty (no directory was named: exporting is off) or
    refused by :func:`check_audit_dir`, or when ``path`` is empty, names a folder (``.``, ``..``, a trailing
    ``/``), holds a NUL or lies outside ``audit_dir``."""
    if not isinstance(path, str) or not path or len(path) > MAX_PATH or "\0" in path:
        raise InputError(f"audit export {str(path)[:200]!r}: not a file path (1 to {MAX_PATH} characters, no NUL)")
    if not audit_dir:
        raise InputError(f"audit export {path}: refused: this process was started without --audit-dir DIR (the "
                         f"directory audit exports must lie in), so it exports nothing and trims nothing")
    root = check_audit_dir(audit_dir)
    folder, name = os.path.split(path)
    if name in ("", ".", ".."):
        raise InputError(f"audit export {path}: names a directory, not a file")
    parent = os.path.realpath(folder or ".")
    target = os.path.join(parent, name)
    if os.path.commonpath([root, parent]) != root:
        raise InputError(f"audit export {path}: refused: it resolves to {target}, outside the audit directory "
                         f"{root} (--audit-dir)")
    return target


def check_audit_dir(audit_dir: str) -> str:
    """The resolved (``..`` and symbolic links) form of ``audit_dir``. :class:`InputError` when it is not a
    directory, or is ``/``, holds or lies in one of :data:`SYSTEM_DIRS` (see the module doc)."""
    root = os.path.realpath(audit_dir)
    if not os.path.isdir(root):
        raise InputError(f"--audit-dir {audit_dir}: not a directory")
    for system in SYSTEM_DIRS:
        common = os.path.commonpath([root, system])
        if common in (root, system):
            where = ("the root directory" if root == "/" else f"{root}, a system directory" if root == system
                     else f"{root}, which holds the system directory {system}" if common == root
                     else f"{root}, inside the system directory {system}")
            raise InputError(f"--audit-dir {audit_dir}: refused: it resolves to {where}; an audit export there "
                             f"could write to the system's files (name a folder of its own, e.g. /var/log/fdeplb)")
    return root


def check_trimming(audit_keep: int, path: str, audit_dir: str | None) -> None:
    """The one rule of audit settings a coordinator will start with (QA MED 1): with ``audit_keep`` > 0 the export
    ``path`` passes :func:`check_export_path` for ``audit_dir``, as at a coordinator's start; with 0 nothing is
    exported, so anything goes. :class:`InputError` (as :func:`check_export_path`) otherwise."""
    if audit_keep:
        check_export_path(path, audit_dir)


def check_export_path(path: str, audit_dir: str | None) -> str:
    """Before anything relies on export ``path`` (``init-cluster``, ``config set``, a coordinator's start): it is
    confined to ``audit_dir`` (:func:`confine_export_path`) and is an existing regular file that can be appended to
    (opened and closed, nothing written) or, when missing, its folder is one this process may create it in.
    Returns the confined absolute path (what the configuration stores). Creates and writes nothing.

    Raises :class:`InputError` naming the path and why (see the module doc)."""
    target = confine_export_path(path, audit_dir)
    try:
        fd = _open_existing(target)
    except FileNotFoundError:
        folder = os.path.dirname(target)
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
            raise InputError(f"audit export {path}: cannot be created (folder {folder} is missing or not "
                             f"writable); older audit records would never be trimmed") from None
        return target
    os.close(fd)
    return target


def open_export(path: str, audit_dir: str | None) -> TextIO:
    """Export ``path`` opened for appending text (UTF-8), confined to ``audit_dir``: an existing regular file, or a
    new one created with ``O_CREAT | O_EXCL`` (mode 0600). The caller writes, flushes, fsyncs and closes it.

    Raises :class:`InputError` naming the path and why (see the module doc); nothing is created then."""
    target = confine_export_path(path, audit_dir)
    try:
        fd = _open_existing(target)
    except FileNotFoundError:
        try:
            fd = os.open(target, _APPEND | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise _refusal(path, exc) from None
        fd = _regular(path, fd)
    return os.fdopen(fd, "a", encoding="utf-8")


def append_lines(fh: TextIO, lines: Sequence[str], ours: Callable[[dict], bool] | None = None) -> int:
    """Append ``lines`` (each one record's JSONL line, ending in a newline, holding the record's stream ``id``;
    oldest first) to the export ``fh`` opened by :func:`open_export`, resuming an earlier attempt. Returns how many
    lines were written (completing a cut one counts). The caller flushes, fsyncs and closes (which releases the
    lock taken here).

    Why resume rather than write a temporary file and rename it: the export is one append-only file holding every
    trim so far, so a rename would copy that whole history at every round's end and replace the file the checks above
    were made on. A retry instead resumes by stream id, which only grows: every line whose id is at or below the last
    id the file holds (its last complete line that is a JSON object with an ``id``; a line that is not, such as an
    ended fragment, is passed over) is skipped, whatever the batch is: an earlier attempt with more records (a
    smaller ``audit_keep``), fewer, or a late writer's (a paused or deposed coordinator) whose records another one
    exported meanwhile. A line cut short at the file's end by a failed write is completed when it is the start of
    the first line written; otherwise it is ended with a newline before anything is written after it (so no record
    is glued to it), or left as it is when nothing is written (the next export completes it).

    ``ours`` (a record of the file -> whether it is one of this cluster's, by id and chain): the resume point is the
    newest record of the file that is this cluster's (:func:`_resume_after`), so records of another cluster given
    the same file never make it skip its own (and trim them unexported); None: every record is taken as its own.

    The file is locked (``flock``, exclusive; released when ``fh`` closes) before its end is read, so two writers
    (a deposed coordinator still running beside the leader) never both append what the other appends; a lock not
    had within :data:`LOCK_WAIT_S` raises :class:`BlockingIOError`.

    Raises OSError when the file cannot be locked, read or written (what was written stays; the next call resumes
    after it)."""
    fh.flush()
    fd = fh.fileno()
    _lock(fd)
    torn = _torn(fd)
    last = _resume_after(fd, ours, _line_id(lines[0]) if lines else None)
    todo = [line.encode("utf-8") for line in lines if last is None or _line_id(line) > last]
    if not todo:
        return 0
    head = b""
    if torn:
        head = todo[0][len(torn):] if todo[0].startswith(torn) else b"\n" + todo[0]
        todo = todo[1:]
    fh.buffer.write(head + b"".join(todo))
    return len(todo) + bool(head)


#: seconds :func:`append_lines` waits for another writer's lock on the export before it gives up: a writer holds
#: it for one append and fsync; one that holds it longer is paused, and the coordinator waiting must not outwait
#: its own lease (renewed every third of ``--lease-ms``, default 3000): it raises the alarm and retries next round
LOCK_WAIT_S = 0.5


def _lock(fd: int) -> None:
    """Take an exclusive ``flock`` on ``fd`` within :data:`LOCK_WAIT_S` (BlockingIOError when not had)."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise BlockingIOError(errno.EWOULDBLOCK, f"another writer held the export's lock for "
                                                         f"{LOCK_WAIT_S:g} s") from None
            time.sleep(0.05)


def _line_record(line: str | bytes) -> dict | None:
    """One export line's record, or None when it is not a JSON object with a stream ``id``."""
    try:
        record = json.loads(line)
        if isinstance(record, dict):
            parse_stream_id(record["id"])
            return record
    except (ValueError, KeyError, TypeError, RecursionError):  # not JSON (or nested too deep), no id, not an id
        pass
    return None


def _line_id(line: str | bytes) -> tuple[int, int] | None:
    """The stream id (ms, seq) of one export line, or None when it is not a JSON object with a stream ``id``."""
    record = _line_record(line)
    return None if record is None else parse_stream_id(record["id"])


def _torn(fd: int) -> bytes:
    """The bytes after the last newline of the file open at ``fd`` (b"" when it ends with one: nothing cut)."""
    pos = os.fstat(fd).st_size
    buf = b""
    while pos > 0:
        step = min(_TAIL_BLOCK, pos)
        pos -= step
        buf = os.pread(fd, step, pos) + buf
        nl = buf.rfind(b"\n")
        if nl >= 0:
            return buf[nl + 1:]
    return buf


def _records_backwards(fd: int) -> Iterator[dict]:
    """The records of the complete lines of the file open at ``fd`` (those that are JSON objects with a stream
    ``id``), newest first, read back from the end a block at a time."""
    pos = os.fstat(fd).st_size
    buf = b""
    first = True
    while pos > 0:
        step = min(_TAIL_BLOCK, pos)
        pos -= step
        buf = os.pread(fd, step, pos) + buf
        nl = buf.rfind(b"\n")
        if nl < 0:
            continue
        if first:  # drop what follows the last newline (a cut line)
            buf, first = buf[:nl + 1], False
        lines = buf.split(b"\n")[:-1]  # complete lines; the first one may be cut by the block's start
        for line in reversed(lines if pos == 0 else lines[1:]):
            record = _line_record(line)
            if record is not None:
                yield record
        buf = b"" if pos == 0 else lines[0] + b"\n"


def _resume_after(fd: int, ours: Callable[[dict], bool] | None, oldest: tuple[int, int] | None
                  ) -> tuple[int, int] | None:
    """The stream id after which the batch resumes: that of the newest record of the file that is this writer's
    (``ours``; every record when None), looking back past others' (newer ones: another cluster's, or this one's
    trimmed by another coordinator meanwhile) until one older than the batch's ``oldest`` id, or
    :data:`MAX_RESUME_SCAN` records; None: write the whole batch."""
    for n, record in enumerate(_records_backwards(fd)):
        if ours is None or ours(record):
            return parse_stream_id(record["id"])
        if n >= MAX_RESUME_SCAN or (oldest is not None and parse_stream_id(record["id"]) < oldest):
            return None
    return None


def _open_existing(target: str) -> int:
    """An fd appending to the existing regular file ``target`` (FileNotFoundError when missing; InputError when it
    is a symbolic link, a hard link, a FIFO, a device, a folder or cannot be opened)."""
    try:
        fd = os.open(target, _APPEND)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _refusal(target, exc) from None
    return _regular(target, fd)


def _regular(path: str, fd: int) -> int:
    """``fd`` when ``fstat`` says it is a regular file with one name (closed and InputError otherwise)."""
    st = os.fstat(fd)
    mode = st.st_mode
    if stat.S_ISREG(mode) and st.st_nlink == 1:
        return fd
    os.close(fd)
    if stat.S_ISREG(mode):
        raise InputError(f"audit export {path}: refused: a hard link ({st.st_nlink} names); its other names may lie "
                         f"outside the audit directory, so it is never written (export to a file of its own)")
    kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
            else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
    raise InputError(f"audit export {path}: refused: {kind}, not a regular file")


def _refusal(path: str, exc: OSError) -> InputError:
    why = {errno.ELOOP: "a symbolic link (refused wherever it points)", errno.ENXIO: "a FIFO or socket, not a regular file",
           errno.EISDIR: "a directory, not a regular file"}.get(exc.errno, exc.strerror or str(exc))
    return InputError(f"audit export {path}: refused: {why}; older audit records would never be trimmed")
