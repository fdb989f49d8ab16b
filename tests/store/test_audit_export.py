"""Which files the audit export may be (issue 34 item B): only a regular file inside the operator's ``--audit-dir``,
``..`` and symbolic links resolved, never a device, a FIFO, a symbolic link or a hard link; a refused path is neither created
nor written. No Redis: :mod:`fdeplb.store.audit_export` alone."""

from __future__ import annotations

import os

import pytest

from fdeplb.errors import InputError
from fdeplb.store import audit_export
from fdeplb.store.audit_export import append_lines, check_audit_dir, check_export_path, check_trimming, \
    confine_export_path, open_export


@pytest.fixture
def audit_dir(tmp_path):
    d = tmp_path / "audit"
    d.mkdir()
    return d


def refused(path, audit_dir, *words: str) -> str:
    """Both the check and the open refuse ``path`` with an InputError holding every word; returns the message."""
    for call in (check_export_path, open_export):
        with pytest.raises(InputError) as info:
            call(str(path), None if audit_dir is None else str(audit_dir))
        for word in words:
            assert word in str(info.value), str(info.value)
    return str(info.value)


def test_a_path_outside_the_audit_dir_is_refused_and_nothing_is_created(audit_dir, tmp_path):
    before = os.stat("/etc/passwd")
    refused("/etc/passwd", audit_dir, "outside the audit directory", str(audit_dir))
    after = os.stat("/etc/passwd")
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    refused(tmp_path / "new.jsonl", audit_dir, "outside the audit directory")
    assert not (tmp_path / "new.jsonl").exists()


def test_dotdot_escapes_are_resolved_before_the_check(audit_dir, tmp_path):
    refused(audit_dir / ".." / "escape.jsonl", audit_dir, f"resolves to {tmp_path / 'escape.jsonl'}")
    refused(audit_dir / "sub" / ".." / ".." / "escape.jsonl", audit_dir, "outside the audit directory")
    refused(audit_dir / "..", audit_dir, "names a directory")
    assert not (tmp_path / "escape.jsonl").exists()
    (audit_dir / "sub").mkdir()  # a '..' that stays inside is fine
    assert check_export_path(str(audit_dir / "sub" / ".." / "a.jsonl"), str(audit_dir)) == str(audit_dir / "a.jsonl")


def test_symbolic_links_are_refused_wherever_they_point(audit_dir, tmp_path):
    outside = tmp_path / "outside.jsonl"
    outside.write_text("precious\n")
    (audit_dir / "out.jsonl").symlink_to(outside)  # the file is a link out of the folder
    refused(audit_dir / "out.jsonl", audit_dir, "a symbolic link")
    assert outside.read_text() == "precious\n"
    (audit_dir / "null").symlink_to("/dev/null")
    refused(audit_dir / "null", audit_dir, "a symbolic link")
    (audit_dir / "in.jsonl").write_text("")
    (audit_dir / "alias.jsonl").symlink_to(audit_dir / "in.jsonl")  # even one pointing inside
    refused(audit_dir / "alias.jsonl", audit_dir, "a symbolic link")
    (audit_dir / "linkdir").symlink_to(tmp_path)  # a folder link out of it: the folder resolves outside
    refused(audit_dir / "linkdir" / "x.jsonl", audit_dir, "outside the audit directory")
    assert not (tmp_path / "x.jsonl").exists()


def test_a_hard_link_is_refused_and_its_other_name_is_not_written(audit_dir, tmp_path):
    outside = tmp_path / "outside.jsonl"  # what someone who may write in the folder could link to (same filesystem)
    outside.write_text("kept\n")
    os.link(outside, audit_dir / "audit.jsonl")
    refused(audit_dir / "audit.jsonl", audit_dir, "a hard link (2 names)", "outside the audit directory")
    assert outside.read_text() == "kept\n"
    os.link(audit_dir / "audit.jsonl", audit_dir / "alias.jsonl")  # even when every name lies inside
    refused(audit_dir / "alias.jsonl", audit_dir, "a hard link (3 names)")


def test_devices_fifos_and_folders_are_refused(audit_dir, monkeypatch):
    refused("/dev/null", audit_dir, "outside the audit directory")
    refused("/dev/null", "/dev", "resolves to /dev, a system directory")  # --audit-dir /dev is refused, and
    monkeypatch.setattr(audit_export, "SYSTEM_DIRS", ())  # without that rule: a device is not a regular file
    refused("/dev/null", "/dev", "a character device, not a regular file")  # even inside its own --audit-dir
    monkeypatch.undo()
    os.mkfifo(audit_dir / "fifo")
    refused(audit_dir / "fifo", audit_dir, "a FIFO")  # no reader: refused at once, not waited on
    reader = os.open(audit_dir / "fifo", os.O_RDONLY | os.O_NONBLOCK)
    try:
        refused(audit_dir / "fifo", audit_dir, "a FIFO, not a regular file")  # with a reader: fstat refuses it
    finally:
        os.close(reader)
    (audit_dir / "folder").mkdir()
    refused(audit_dir / "folder", audit_dir, "a directory")
    refused(str(audit_dir) + "/", audit_dir, "names a directory")


def test_without_an_audit_dir_every_path_is_refused(audit_dir, tmp_path):
    refused(audit_dir / "a.jsonl", None, "without --audit-dir", "trims nothing")
    refused(audit_dir / "a.jsonl", tmp_path / "missing", "not a directory")
    refused("", audit_dir, "not a file path")
    refused("a\0b", audit_dir, "no NUL")
    assert not (audit_dir / "a.jsonl").exists()


def test_a_regular_file_inside_is_created_exclusively_then_appended_to(audit_dir, monkeypatch):
    path = audit_dir / "audit.jsonl"
    assert check_export_path(str(path), str(audit_dir)) == str(path)
    assert not path.exists()  # the check creates nothing
    with open_export(str(path), str(audit_dir)) as fh:
        fh.write("one\n")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    with open_export(str(path), str(audit_dir)) as fh:
        fh.write("two\n")
    assert path.read_text() == "one\ntwo\n"
    monkeypatch.chdir(audit_dir)  # a relative path is the working directory's, stored absolute
    assert confine_export_path("audit.jsonl", str(audit_dir)) == str(path)


def test_a_retried_export_resumes_after_the_lines_already_written(audit_dir, monkeypatch):
    monkeypatch.setattr(audit_export, "_TAIL_BLOCK", 7)  # lines longer than a block: the walk back spans blocks
    path, folder = str(audit_dir / "a.jsonl"), str(audit_dir)
    lines = [f'{{"id": "1-{i}", "x": "{"é" * (i + 1)}"}}\n' for i in range(4)]
    with open_export(path, folder) as fh:  # an earlier trim, then one line and a line cut inside its "é"
        fh.buffer.write(b"earlier\n" + lines[0].encode() + lines[1].encode()[:21])
    with open_export(path, folder) as fh:
        append_lines(fh, lines[:3])
    assert (audit_dir / "a.jsonl").read_text() == "earlier\n" + "".join(lines[:3])
    with open_export(path, folder) as fh:  # again with one more (the export was written, the trim did not run)
        append_lines(fh, lines)
    assert (audit_dir / "a.jsonl").read_text() == "earlier\n" + "".join(lines)
    with open_export(path, folder) as fh:  # a fragment that is not the next line is ended, not completed
        fh.write('{"id": "9-9"')
    with open_export(path, folder) as fh:
        append_lines(fh, [*lines, '{"id": "1-4"}\n'])
    assert (audit_dir / "a.jsonl").read_text() == "earlier\n" + "".join(lines) + '{"id": "9-9"\n{"id": "1-4"}\n'


def test_a_retry_with_another_batch_resumes_by_stream_id(audit_dir, monkeypatch):
    monkeypatch.setattr(audit_export, "_TAIL_BLOCK", 16)  # the walk back spans blocks
    path, folder = str(audit_dir / "a.jsonl"), str(audit_dir)
    lines = [f'{{"id": "5-{i}", "n": {i}}}\n' for i in range(8)]
    with open_export(path, folder) as fh:  # 5 lines, an ended fragment, then the start of the 6th cut short
        fh.buffer.write("".join(lines[:5]).encode() + b'{"id": "5-4", "n"\n' + lines[5].encode()[:9])
    before = (audit_dir / "a.jsonl").read_bytes()
    with open_export(path, folder) as fh:  # a smaller batch (audit_keep raised), all held already: nothing written
        assert append_lines(fh, lines[:3]) == 0
    assert (audit_dir / "a.jsonl").read_bytes() == before  # the cut line stays last, for the next export to complete
    with open_export(path, folder) as fh:  # a larger batch: the cut line completed, then the rest
        assert append_lines(fh, lines) == 3
    text = (audit_dir / "a.jsonl").read_text()
    assert text == "".join(lines[:5]) + '{"id": "5-4", "n"\n' + "".join(lines[5:])
    with open_export(path, folder) as fh:  # a late writer's batch, every record in the file already
        assert append_lines(fh, lines[2:6]) == 0
    assert (audit_dir / "a.jsonl").read_text() == text


def test_a_file_without_a_record_line_gets_the_whole_batch(audit_dir):
    path, folder = str(audit_dir / "a.jsonl"), str(audit_dir)
    (audit_dir / "a.jsonl").write_text('[1, 2]\n{"id": "not-an-id"}\n{"no": "id"}\ncut')
    with open_export(path, folder) as fh:
        assert append_lines(fh, ['{"id": "1-0"}\n', '{"id": "1-1"}\n']) == 2
    assert (audit_dir / "a.jsonl").read_text().endswith('cut\n{"id": "1-0"}\n{"id": "1-1"}\n')


def test_a_second_writer_waits_for_the_lock_then_gives_up(audit_dir, monkeypatch):
    import fcntl

    monkeypatch.setattr(audit_export, "LOCK_WAIT_S", 0.05)
    path, folder = str(audit_dir / "a.jsonl"), str(audit_dir)
    with open_export(path, folder) as holder:
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX)
        with open_export(path, folder) as fh, pytest.raises(BlockingIOError, match="lock"):
            append_lines(fh, ['{"id": "1-0"}\n'])
    assert (audit_dir / "a.jsonl").read_text() == ""  # nothing written without the lock
    with open_export(path, folder) as fh:  # the holder closed: the lock is free
        assert append_lines(fh, ['{"id": "1-0"}\n']) == 1


@pytest.mark.parametrize("root,words", [("/", "the root directory"), ("/etc", "/etc, a system directory"),
                                        ("/usr/share", "inside the system directory /usr"),
                                        ("/dev/..", "the root directory")])
def test_an_audit_dir_that_reaches_the_system_files_is_refused(root, words):
    with pytest.raises(InputError, match="--audit-dir .*: refused: it resolves to") as info:
        check_audit_dir(root)
    assert words in str(info.value)
    refused("/etc/passwd" if root != "/" else "/tmp/x.jsonl", root, words)  # every export path in it too


def test_an_audit_dir_of_its_own_is_fine_and_trimming_off_needs_no_export(audit_dir, tmp_path):
    assert check_audit_dir(str(audit_dir / ".")) == str(audit_dir)
    with pytest.raises(InputError, match="not a directory"):
        check_audit_dir(str(tmp_path / "missing"))
    check_trimming(0, "/etc/passwd", None)  # nothing is exported: nothing to check
    with pytest.raises(InputError, match="outside the audit directory"):
        check_trimming(1, "/etc/passwd", str(audit_dir))
    check_trimming(1, str(audit_dir / "a.jsonl"), str(audit_dir))
