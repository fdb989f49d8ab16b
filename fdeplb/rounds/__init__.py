"""The pure rules of a round, shared by the coordinator, the replay, the UI, the API and the CLI: the gain gate and
the planner (:mod:`~fdeplb.rounds.gating`), the audited reasons and the round-outcome rule
(:mod:`~fdeplb.rounds.reasons`), and the rules over the ranks' membership (:mod:`~fdeplb.rounds.members`).

No I/O, no clock: numpy over :mod:`fdeplb.placement` and the store's typed records.
"""

from fdeplb.rounds.gating import GateDecision, Planner, decide, default_planner, mean_balancedness, plan_round
from fdeplb.rounds.members import live_mask, replacement
from fdeplb.rounds.reasons import Reason, RoundOutcome, round_outcome

__all__ = ["GateDecision", "Planner", "Reason", "RoundOutcome", "decide", "default_planner", "live_mask",
           "mean_balancedness", "plan_round", "replacement", "round_outcome"]
