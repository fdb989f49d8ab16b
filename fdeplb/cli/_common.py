"""Helpers shared by the CLI subcommands."""

from __future__ import annotations

from fdeplb.errors import NotFoundError


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
