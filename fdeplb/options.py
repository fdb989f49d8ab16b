"""Command-line pieces shared by every fdeplb entry point (``fdeplb`` and ``python -m fdeplb.sim.worker``): the
one declaration of ``--redis-url`` / ``--cluster`` and of ``--audit-dir`` (argparse parents) and the
positive-number argument types.

argparse only, no I/O. A bad value is argparse's usage error (exit 2, naming the option).
"""

from __future__ import annotations

import argparse
import math

__all__ = ["audit_dir_parent", "cluster_parent", "positive_float", "positive_int"]


def cluster_parent(*, required: bool = True) -> argparse.ArgumentParser:
    """An argparse parent (``parents=[cluster_parent()]``) declaring ``--redis-url`` and ``--cluster``, required
    or not (a fresh parser each call: argparse shares a parent's actions with every child)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--redis-url", required=required, help="redis://host:port/db, rediss://... or unix:///path")
    p.add_argument("--cluster", required=required, help="cluster id")
    return p


def audit_dir_parent() -> argparse.ArgumentParser:
    """An argparse parent declaring ``--audit-dir DIR`` (default None), for the commands that set the audit export
    path and the processes that write it: the only directory that export may lie in
    (:mod:`fdeplb.store.audit_export`); without it every export path is refused."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--audit-dir", default=None, metavar="DIR",
                   help="the only directory the audit export (--audit-export, audit_keep) may lie in, symbolic links "
                        "and '..' resolved; without it every export path is refused and the audit is never trimmed")
    return p


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer > 0, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse ``type=``: a finite number > 0 (seconds, for instance)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value
