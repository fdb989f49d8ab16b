"""The self-contained check of one recording file, as ``fdeplb replay FILE`` runs it and the pytest plugin
(:mod:`fdeplb.replay.pytest_plugin`) runs it for every recording of a folder: the machine replay
(:func:`~fdeplb.replay.machine_replay.replay_file`), then every plan recomputed from the recording
(:func:`~fdeplb.replay.recompute.check_plans`) and every gated round's numbers
(:func:`~fdeplb.replay.recompute.check_gates`). No Redis.
"""

from __future__ import annotations

from pathlib import Path

from fdeplb.errors import ReplayError
from fdeplb.replay.machine_replay import replay_file
from fdeplb.replay.recompute import Recorded, check_gates, check_plans
from fdeplb.replay.report import ReplayReport

__all__ = ["check_recording"]


def check_recording(path: str | Path, until: str | None = None) -> ReplayReport:
    """Replay the recording at ``path`` and recompute what it claims (see the module doc); returns the report.

    Raises :class:`~fdeplb.errors.ReplayError` naming the first bad line (also for a file with no audit record),
    :class:`~fdeplb.errors.InputError` for a file that cannot be read or a bad ``until``."""
    report = replay_file(path, until)
    if report.records == 0:
        raise ReplayError(f"{path}: no audit records (a recording has one JSON object per line)")
    if report.header is not None:
        check_plans(Recorded(report), report)
        check_gates(report)
    return report
