"""``fdeplb rank exclude|drain|readmit``: the operator's membership commands on one EP rank, each an audited
transition of the rank's membership record (the actor names who ran it, the reason why), raising the cluster's
generation in the same step. A command that is not legal from the rank's current membership state changes nothing
and exits non-zero (:class:`~fdeplb.errors.IllegalTransitionError`, exit 3)."""

from __future__ import annotations

import argparse
import getpass
import socket
import sys

from fdeplb.cli._common import open_store
from fdeplb.errors import FdeplbError
from fdeplb.options import cluster_parent

#: the commands and what each does (argparse help)
COMMANDS = {
    "exclude": "exclude a SUSPECT rank at once (without waiting for deadlines.exclude_ms)",
    "drain": "remove an ACTIVE rank as planned: it leaves the members between rounds",
    "readmit": "take an EXCLUDED or DRAINING rank back as an ACTIVE member",
}


def register(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("rank", help="membership of one EP rank: exclude, drain, readmit",
                       description="Change one EP rank's membership, audited with who and why. Only ACTIVE members "
                                   "count in a round; a rank's exclusion starts a re-placement of its experts.")
    cmds = r.add_subparsers(dest="rank_command", metavar="COMMAND")
    cmds.required = True
    for name, text in COMMANDS.items():
        c = cmds.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".",
                            parents=[cluster_parent()])
        c.add_argument("--rank", type=int, required=True, help="the EP rank")
        c.add_argument("--reason", default="", help="why (kept in the audit record)")
        c.set_defaults(handler=run_rank, rank_command=name)


def operator_id() -> str:
    """``operator:<user>@<host>``: the actor of an operator's membership command."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no user name in this environment
        user = "unknown"
    return f"operator:{user}@{socket.gethostname()}"


def run_rank(args: argparse.Namespace) -> int:
    from fdeplb.checks import check_int
    from fdeplb.orchestration.membership import operator_fire
    from fdeplb.store.records import check_request_reason

    store = open_store(args.redis_url, args.cluster)
    check_int(args.rank, "--rank", lo=0, hi=store.ep_size() - 1)
    check_request_reason(args.reason)
    fired = operator_fire(store, args.rank, args.rank_command, who=operator_id(), reason=args.reason)
    gen = store.read_cluster().generation
    print(f"rank {args.rank}: {fired.before.state} -> {fired.state} ({args.rank_command}); generation {gen}")
    if args.rank_command != "readmit":
        try:
            uncovered = _fails_closed(store, args.rank)
        except FdeplbError:  # advice only: the command is done, a record that does not read is `status`'s to show
            uncovered = ""
        if uncovered:
            print(f"note: {uncovered}", file=sys.stderr)
    return 0


def _fails_closed(store, ep_rank: int) -> str:
    """Why the membership round that takes ``ep_rank`` out will fail closed (the ACTIVE members left lack the
    redundant slots for the experts only it holds: :func:`fdeplb.rounds.members.replacement`), or "". The command
    stands; the operator learns now what ``status`` shows after that round (DEGRADED, ``/health`` 503)."""
    import numpy as np

    from fdeplb.rounds.members import replacement

    cfg = store.read_config()
    active = [r for r in store.restored_view().active() if r != ep_rank]
    live = np.zeros(cfg.ep_size, dtype=bool)
    live[active] = True
    _, refused = replacement(store.current_placement().phy2log, cfg.num_logical_experts, cfg.ep_size, live, None)
    if refused is None:
        return ""
    return (f"the ACTIVE members left ({', '.join(map(str, active))}) cannot hold every expert ({refused.text}): the "
            f"membership round that takes rank {ep_rank} out fails closed (status DEGRADED, /health 503) until it "
            f"is readmitted (`fdeplb rank readmit`) or another rank is back")
