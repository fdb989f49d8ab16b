"""Helpers shared by the CLI subcommands."""

from __future__ import annotations

from pathlib import Path

from fdeplb.errors import InputError, NotFoundError


def check_out_folder(flag: str, path: str | None) -> None:
    """Before any work: :class:`InputError` when output file ``path`` (given as ``flag``) is a folder or the folder
    it goes into does not exist. Nothing to check when ``path`` is None."""
    if path is not None and Path(path).is_dir():
        raise InputError(f"{flag} {path}: is a folder; name the file to write")
    if path is not None and not Path(path).resolve().parent.is_dir():
        raise InputError(f"{flag} {path}: folder {Path(path).resolve().parent} does not exist")


def open_store(url: str, cluster: str):
    """A :class:`~fdeplb.store.Store` for an existing cluster.

    Raises :class:`InputError` (bad URL or cluster id), :class:`RedisUnavailableError` (no answer) or
    :class:`NotFoundError` (no such cluster at that Redis).
    """
    from fdeplb.store import Store

    store = Store(url, cluster)
    store.ping()
    try:
        store.read_config()
    except NotFoundError:
        raise NotFoundError(f"no cluster {cluster!r} at {url} (never initialised, or another Redis db)") from None
    return store
