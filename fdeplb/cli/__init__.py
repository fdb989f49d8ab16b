"""``fdeplb`` command line: run a demo, plan placements, operate and inspect clusters.

A subcommand's handler returns an exit code; :class:`fdeplb.errors.FdeplbError` raised by it is printed as
``error: <message>`` on stderr and mapped to its exit code by :func:`fdeplb.errors.exit_code`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from fdeplb import __version__
from fdeplb.errors import FdeplbError, exit_code

__all__ = ["build_parser", "main"]

#: modules under fdeplb.cli that define ``register(subparsers)``; each adds one or more subcommands.
SUBCOMMAND_MODULES = ("demo", "planning", "operate", "views", "statecharts")


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
        return int(args.handler(args) or 0)
    except FdeplbError as err:
        print(f"error: {err}", file=sys.stderr)
        return exit_code(err)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
