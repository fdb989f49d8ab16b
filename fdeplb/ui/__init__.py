"""The web view of a cluster (``/ui`` on ``fdeplb serve``) and of a recording (``fdeplb replay --ui``).

:mod:`~fdeplb.ui.view_model` is the UI's read model (what the page shows, computed in Python: machine states,
rank grid, round timeline, audit table, last plan), :mod:`~fdeplb.ui.player` the same over a recording, step by
step, with the replay's checks; ``static/`` holds the page itself (plain HTML, CSS and JavaScript, no build step,
nothing fetched from the internet). The HTTP routes are :mod:`fdeplb.api.ui_routes`.
"""

from pathlib import Path

from fdeplb.ui.player import PlayerModel
from fdeplb.ui.view_model import LiveReadModel, annotated_diagrams, build_view

#: the page's files, served by :mod:`fdeplb.api.ui_routes`
STATIC_DIR = Path(__file__).resolve().parent / "static"

__all__ = ["LiveReadModel", "PlayerModel", "STATIC_DIR", "annotated_diagrams", "build_view"]
