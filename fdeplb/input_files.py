"""The rule for every file fdeplb reads or writes by a path it was given (expert-load dumps, placement and plan
files, recordings, credentials files): a regular file (at most :data:`MAX_INPUT_BYTES` when read), opened without ever
blocking.

A FIFO, a device (``/dev/zero``), a socket or a folder is refused with a typed error naming the path and what it is,
before a byte is read: opening a FIFO for reading would wait for a writer forever and a device may never end. The
file is opened with ``O_NONBLOCK`` (so opening a FIFO returns at once) and then judged by ``fstat`` of the descriptor
it opened, so a name swapped between a check and the open cannot slip past. (``fdeplb.store.audit_export`` has the
same care for the file it appends to.)

An output (``--out``, ``--export``, ``--placement-out``...) follows the same rule: :func:`check_output` refuses an
existing FIFO, device (``/dev/stdout`` too: fdeplb writes no output file to a stream), socket or folder before any
work, and :func:`open_output` opens the file it writes without blocking and judges the descriptor again, so writing
never waits for a reader that never comes. A missing file is created; a regular file (or a link to one) is
overwritten, as before.
"""

from __future__ import annotations

import io
import os
import stat

from fdeplb.errors import FdeplbError, InputError

__all__ = ["MAX_INPUT_BYTES", "check_output", "open_input", "open_output", "read_input", "write_output"]

#: the most bytes an input file may hold (on disk, and once decompressed for ``.gz`` documents); generous: a
#: DeepSeek-V3 per-rank stacked load dump (EP320) is about 10 MB
MAX_INPUT_BYTES = 512 << 20


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a socket" if stat.S_ISSOCK(mode) else "not a regular file"


def open_input(path, what: str, error: type[FdeplbError] = InputError, *,
               max_bytes: int | None = MAX_INPUT_BYTES) -> io.BufferedReader:
    """``path`` opened for reading in binary mode, when it is a regular file of at most ``max_bytes`` (None: any
    size, for files read as a stream).

    Raises:
        ``error`` (an :class:`InputError` by default; a reader's own typed error, e.g. ``CheckpointError``): missing, unreadable, not a regular file (FIFO, device, socket,
            folder), or larger than ``max_bytes``; the message names the path and ``what`` it is. Nothing was read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise error(f"{path}: {what} not found") from None
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: {what} is {_kind(st.st_mode)}, not a regular file; refused")
        if max_bytes is not None and st.st_size > max_bytes:
            raise error(f"{path}: {what} holds {st.st_size} bytes, more than the {max_bytes} an input may hold")
        os.set_blocking(fd, True)
        return open(fd, "rb", closefd=True)  # noqa: SIM115 - the caller closes it
    except BaseException:
        os.close(fd)
        raise


def read_input(path, what: str, error: type[FdeplbError] = InputError) -> bytes:
    """The bytes of ``path`` (:func:`open_input`'s rule); ``error`` also when the file grew past
    :data:`MAX_INPUT_BYTES` while it was read."""
    with open_input(path, what, error) as f:
        try:
            data = f.read(MAX_INPUT_BYTES + 1)
        except OSError as exc:
            raise error(f"{path}: cannot read {what}: {exc.strerror}") from None
    if len(data) > MAX_INPUT_BYTES:
        raise error(f"{path}: {what} holds more than the {MAX_INPUT_BYTES} bytes an input may hold")
    return data


def _not_regular(path, what: str, mode: int, error: type[FdeplbError], label: str | None = None) -> FdeplbError:
    return error(f"{path if label is None else label}: {what} would be written to {_kind(mode)}, not a regular file; "
                 f"refused (name a file)")


def check_output(path, what: str, error: type[FdeplbError] = InputError, label: str | None = None) -> None:
    """Before any work: ``error`` when ``path`` exists and is not a regular file (after links): a FIFO (writing
    would wait for a reader), a device, a socket or a folder. A missing path, or one that cannot be examined, is
    left to :func:`open_output` to judge. Nothing is opened or created. The message starts with ``label`` (default:
    the path)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return
    if not stat.S_ISREG(mode):
        raise _not_regular(path, what, mode, error, label)


def open_output(path, what: str, error: type[FdeplbError] = InputError,
                label: str | None = None) -> io.BufferedWriter:
    """``path`` opened for writing in binary mode, truncated: created when missing (mode 0666 less the umask, as
    ``open(path, "wb")``), else it must be a regular file (a link to one is followed). Opened with ``O_NONBLOCK``
    and judged by ``fstat`` of the descriptor it opened: a FIFO or device is refused, never waited on.

    Raises:
        ``error``: not a regular file (FIFO, device, socket, folder) or cannot be opened; the message names the
            path (or ``label``) and ``what`` it would hold. Nothing was written (an existing file is left as it was).
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY, 0o666)
    except OSError as exc:
        try:  # a FIFO with no reader refuses a non-blocking open (ENXIO), a folder refuses writing (EISDIR)
            mode = os.stat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise _not_regular(path, what, mode, error, label) from None
        raise error(f"{path if label is None else label}: cannot write {what}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, what, st.st_mode, error, label)
        os.set_blocking(fd, True)
        os.ftruncate(fd, 0)
        return open(fd, "wb", closefd=True)  # noqa: SIM115 - the caller closes it
    except OSError as exc:
        os.close(fd)
        raise error(f"{path if label is None else label}: cannot write {what}: {exc.strerror}") from None
    except BaseException:
        os.close(fd)
        raise


def write_output(path, data: bytes, what: str, error: type[FdeplbError] = InputError,
                 label: str | None = None) -> None:
    """Write ``data`` to ``path`` (:func:`open_output`'s rule: a regular file, created or overwritten; a FIFO or
    device refused, never waited on). ``error`` (its message starting with ``label``, default the path) when it is
    refused or cannot be written."""
    with open_output(path, what, error, label) as f:
        try:
            f.write(data)
        except OSError as exc:
            raise error(f"{path if label is None else label}: cannot write {what}: {exc.strerror}") from None
