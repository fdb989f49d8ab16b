"""Recordings as tests: a pytest plugin (entry point ``pytest11``, ``fdeplb.replay.pytest_plugin``).

``pytest --fdeplb-recordings DIR`` collects every recording under DIR (``*.jsonl``, recursively, in path order) as
one test item, ``<path>::replay``, that replays it against the installed fdeplb with no Redis
(:func:`fdeplb.replay.verify.check_recording`: the machine tables, versions, fences, guards, membership and
generations, the audit chain, every plan recomputed with the placement policies, every gated round's numbers). A
recording that does not replay fails with its record number (the line of the file) and the reason; a file that
cannot be read fails saying so. The option may be given more than once; a relative DIR is taken from the
directory pytest was started in, else from the rootdir (for ``addopts`` in a project's configuration). DIR must be
a folder (a usage error otherwise). Without the option the plugin does nothing.

Nothing of fdeplb is imported until a recording item runs, so the plugin costs nothing in other test runs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

#: the option's destination on ``config.option``
OPTION = "fdeplb_recordings"
#: the first line a ReplayError names (its messages start ``line N``: the record's line in the file)
_LINE = re.compile(r"line (\d+)")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fdeplb", "fdeplb recordings")
    group.addoption("--fdeplb-recordings", action="append", default=[], dest=OPTION, metavar="DIR",
                    help="collect every fdeplb recording (*.jsonl, recursively) under DIR as a test that replays "
                         "it against the installed fdeplb (repeatable)")


def _folders(config: pytest.Config) -> list[Path]:
    """The recording folders of the option, resolved and deduplicated; UsageError for one that is not a folder."""
    out: list[Path] = []
    for given in config.getoption(OPTION) or []:
        path = Path(given)
        if not path.is_absolute():
            here = config.invocation_params.dir / path
            path = here if here.exists() else config.rootpath / path
        if not path.is_dir():
            raise pytest.UsageError(f"--fdeplb-recordings {given}: not a folder")
        path = path.resolve()
        if path not in out:
            out.append(path)
    return out


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_FOLDERS] = _folders(config)


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect: recording items are selected like any other
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    files = sorted({p for folder in config.stash.get(_FOLDERS, []) for p in folder.rglob("*.jsonl") if p.is_file()})
    for path in files:  # each once, also when the folders nest
        # genitems: the collection protocol (collect reports, counted and shown like any other file's)
        items.extend(session.genitems(RecordingFile.from_parent(session, path=path)))


_FOLDERS = pytest.StashKey[list]()


class RecordingFile(pytest.File):
    """A recording file: one :class:`RecordingItem`."""

    def collect(self):
        yield RecordingItem.from_parent(self, name="replay")


class RecordingItem(pytest.Item):
    """Replays one recording; fails with the record number and the reason."""

    def runtest(self) -> None:
        from fdeplb.replay.verify import check_recording

        check_recording(self.path)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        from fdeplb.errors import InputError, ReplayError

        error = excinfo.value
        if isinstance(error, ReplayError):
            message = str(error)
            m = _LINE.match(message)
            where = f"record {m[1]} (line {m[1]})" if m else "the recording"
            return f"recording {self.path}: {where} does not replay: {message}"
        if isinstance(error, InputError):  # unreadable: not a verdict on its records
            return f"recording {self.path}: cannot be replayed: {error}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"recording {self.path.name}"
