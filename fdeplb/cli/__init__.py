"""``fdeplb`` command line: run a demo, plan placements, operate and inspect clusters.

A subcommand's handler returns an exit code; :class:`fdeplb.errors.FdeplbError` raised by it is printed as
``error: <message>`` on stderr and mapped to its exit code by :func:`fdeplb.errors.exit_code`. A reader that
closes the pipe early (``| head``) ends the command quietly with exit 0.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from fdeplb import __version__
from fdeplb.errors import FdeplbError, exit_code

__all__ = ["build_parser", "main"]

#: modules under fdeplb.cli that define ``register(subparsers)``; each adds one or more subcommands.
SUBCOMMAND_MODULES = ("demo", "planning", "load_cmd", "operate", "rank_cmd", "cluster_cmd", "audit_view", "status_view", "replay_view", "statecharts", "serve",
                      "http_client")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fdeplb", description="fdeplb: expert-rearrangement orchestration for "
                                     "MoE serving, as audited state machines in Redis.")
    parser.add_argument("--version", action="version", version=f"fdeplb {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"fdeplb.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(args.handler(args) or 0)
        sys.stdout.flush()  # here, not at exit: a closed pipe is then caught below
        return code
    except FdeplbError as err:
        print(f"error: {err}", file=sys.stderr)
        return exit_code(err)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `fdeplb status | head -1`: the reader has what it wants; no traceback
        _silence_stdout()
        return 0


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's final flush does not hit the closed pipe again."""
    import os

    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
