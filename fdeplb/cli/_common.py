"""Helpers shared by the CLI subcommands: output-file checks, opening a cluster's store, and the options of the
views that read either from Redis or through ``fdeplb serve``'s HTTP API."""

from __future__ import annotations

import argparse
from pathlib import Path

from fdeplb.errors import InputError, NotFoundError
from fdeplb.input_files import check_output
from fdeplb.options import cluster_parent


def check_out_folder(flag: str, path: str | None) -> None:
    """Before any work: :class:`InputError` when output file ``path`` (given as ``flag``) is a folder, exists and is
    not a regular file (a FIFO would block the write, a device such as ``/dev/stdout`` is no file:
    :func:`fdeplb.input_files.check_output`), or the folder it goes into does not exist. Nothing to check when
    ``path`` is None."""
    if path is not None and Path(path).is_dir():
        raise InputError(f"{flag} {path}: is a folder; name the file to write")
    if path is not None:
        check_output(path, "the output", label=f"{flag} {path}")
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


def redis_or_url_parent() -> argparse.ArgumentParser:
    """An argparse parent for a view that reads from Redis (``--redis-url`` and ``--cluster``) or through an
    ``fdeplb serve`` (``--url``, ``--credentials-file``); which one is given is checked by :func:`through_http`."""
    p = argparse.ArgumentParser(add_help=False, parents=[cluster_parent(required=False)])
    p.add_argument("--url", default=None, help="read through the HTTP API (http://host:port) instead of Redis")
    p.add_argument("--credentials-file", default=None, metavar="FILE", help="with --url: USER:PASSWORD file")
    p.add_argument("--ca-cert", default=None, metavar="PEM",
                   help="with an https:// --url: verify the server against this CA bundle (default: "
                        "REQUESTS_CA_BUNDLE, else the system's)")
    return p


def through_http(args: argparse.Namespace) -> bool:
    """True when the view reads through ``--url``; InputError when neither --url nor --redis-url + --cluster."""
    if args.url is not None:
        if args.redis_url is not None or args.cluster is not None:
            raise InputError("give --url, or --redis-url and --cluster, not both")
        return True
    if args.redis_url is None or args.cluster is None:
        raise InputError("give --redis-url and --cluster (or --url of an `fdeplb serve`)")
    return False
