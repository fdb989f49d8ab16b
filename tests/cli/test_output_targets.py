"""Every file fdeplb writes by a path (``--out``, ``--export``, ``--placement-out``, ``--export-audit``) is a regular
file: an existing FIFO (writing would wait for a reader forever), a device (``/dev/null``, ``/dev/stdout``) or a
folder is refused at once with a typed error (exit 2 in the CLI), and nothing is written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from fdeplb.errors import InputError, PlacementFileError
from fdeplb.placement import initial_placement, write_placement
from fdeplb.placement.documents import write_document
from tests.helpers import run_cli, within


@pytest.fixture(params=["fifo", "fifo with a reader", "device", "folder"])
def target(request, tmp_path):
    kind = request.param
    if kind == "device":
        yield Path(os.devnull), "a device"
        return
    if kind == "folder":
        yield tmp_path, "a folder"
        return
    path = tmp_path / "out.json"
    os.mkfifo(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK) if kind == "fifo with a reader" else None
    yield path, "a FIFO"
    if fd is not None:
        assert os.read(fd, 1) == b""  # nothing was written into it
        os.close(fd)


def test_the_writer_refuses_a_target_that_is_not_a_regular_file(target):
    path, words = target
    with pytest.raises(InputError, match=f"{path}: a load dump would be written to {words}, not a regular file"):
        within(lambda: write_document(path, "{}", kind="json", what="a load dump"), fifo=path)
    with pytest.raises(PlacementFileError, match=f"would be written to {words}"):
        within(lambda: write_placement(initial_placement(1, 4, 4), path), fifo=path)


def test_the_writer_still_creates_and_overwrites_regular_files_and_follows_links(tmp_path):
    path = tmp_path / "p.json"
    write_document(path, '{"a": 1}', kind="json", what="a document")
    write_document(path, "{}", kind="json", what="a document")  # shorter: truncated, not left with a tail
    assert path.read_text() == "{}"
    link = tmp_path / "link.json"
    link.symlink_to(path)
    write_document(link, "[]", kind="json", what="a document")
    assert link.is_symlink() and path.read_text() == "[]"


def test_cli_outputs_that_are_fifos_exit_2_at_once(tmp_path, capsys, small_store, redis_url):
    """``rebalance --out``, ``status --placement-out``, ``load --export`` and ``audit --export`` naming a FIFO (or
    /dev/stdout's kind: a device) exit 2 with one line naming the flag, before any work."""
    load = tmp_path / "load.json"
    load.write_text(json.dumps({"logical_count": np.arange(1, 9).reshape(2, 4).tolist()}))
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    cluster = ("--redis-url", redis_url, "--cluster", small_store.cluster)
    for argv, flag in (
            (("rebalance", "--load", str(load), "--num-replicas", "6", "--num-gpus", "2", "--out", str(fifo)),
             "--out"),
            (("status", *cluster, "--placement-out", str(fifo)), "--placement-out"),
            (("load", *cluster, "--export", str(fifo)), "--export"),
            (("audit", *cluster, "--export", str(fifo)), "--export")):
        code, out, err = within(lambda: run_cli(capsys, *argv), fifo=fifo)
        assert code == 2 and out == "", (argv, out, err)
        assert err.startswith(f"error: {flag} {fifo}: ") and "a FIFO, not a regular file" in err, (argv, err)
    code, _, err = run_cli(capsys, "status", *cluster, "--placement-out", os.devnull)
    assert code == 2 and "a device, not a regular file" in err


def test_statecharts_into_a_folder_holding_a_fifo_exit_2_at_once(tmp_path, capsys):
    """`fdeplb statecharts --out DIR` rewrites the files of DIR that changed: one that is a FIFO blocked it."""
    fifo = tmp_path / "cluster.mmd"
    os.mkfifo(fifo)
    code, out, err = within(lambda: run_cli(capsys, "statecharts", "--out", str(tmp_path)), fifo=fifo)
    assert code == 2 and f"{fifo}: a statechart would be written to a FIFO, not a regular file" in err, out + err


@pytest.mark.parametrize("kind", ["device", "file", "under a file"])
def test_statecharts_out_that_is_no_folder_exits_2_with_one_line(tmp_path, capsys, kind):
    """`fdeplb statecharts --out PATH` names a folder: a device (``/dev/stdout``'s kind), a regular file or a path
    under one is a one-line error and exit 2 (it was a FileExistsError / NotADirectoryError traceback, exit 1)."""
    file = tmp_path / "charts.txt"
    file.write_text("kept")
    out = {"device": Path(os.devnull), "file": file, "under a file": file / "charts"}[kind]
    code, stdout, err = run_cli(capsys, "statecharts", "--out", str(out))
    assert code == 2 and stdout == "" and err.startswith(f"error: --out {out}: "), (code, stdout, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert file.read_text() == "kept"


def test_statecharts_write_nothing_when_one_target_is_a_fifo(tmp_path, capsys):
    """A FIFO among the files of ``statecharts --out DIR`` is refused before any file is written: a stale file
    written before it would break the rule "nothing written" of a refused output."""
    stale = tmp_path / "cluster.mmd"
    stale.write_text("stale")
    fifo = tmp_path / "weights.dot"  # after cluster.mmd in the writing order
    os.mkfifo(fifo)
    code, out, err = within(lambda: run_cli(capsys, "statecharts", "--out", str(tmp_path)), fifo=fifo)
    assert code == 2 and f"{fifo}: a statechart would be written to a FIFO" in err, out + err
    assert stale.read_text() == "stale"
