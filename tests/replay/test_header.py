"""A recording's header checked against its chained records (issue 34 item 8): an edited setting fails the replay at
line 1 with the reason; the configuration each round ran with is the header's with the range's config_changed notes
undone (the header is the configuration at the range's end); existing recordings still replay."""

from __future__ import annotations

import json
import re

import pytest

from fdeplb.cli import main
from fdeplb.errors import InputError, ReplayError
from fdeplb.orchestration.cluster_setup import init_cluster
from fdeplb.placement import initial_placement
from fdeplb.recording import export_recording
from fdeplb.replay.header_checks import config_before
from fdeplb.replay import check_gates, replay_file
from fdeplb.store import ClusterConfig, Store
from tests.replay.helpers import RECORDINGS, SCHEMA1, lines_of


def _write(tmp_path, lines, name="edited.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def _replay_fails(capsys, path, reason: str) -> str:
    assert main(["replay", *([str(path)] if not isinstance(path, list) else path)]) == 1
    err = capsys.readouterr().err
    assert re.search(reason, err), err
    return err


def test_min_gain_raised_over_a_committed_round_fails_at_the_header(tmp_path, capsys):
    lines = lines_of("happy")
    lines[0]["config"]["min_gain"] = 0.9  # its round 1 went on with a gain of 0.56
    _replay_fails(capsys, _write(tmp_path, lines),
                  r"^error: line 1: the header's configuration has min_gain 0.9 for round 1, but the round went on "
                  r"\(load at line 4 .*\) with a planned gain of 0\.5627 .*which that min_gain skips")
    lines[0]["config"]["min_gain"] = 0.5  # below the round's gain: nothing in the records contradicts it
    assert main(["replay", str(_write(tmp_path, lines))]) == 0


@pytest.mark.parametrize("recording,edit,reason", [
    ("gated_skip", ("config", "min_gain", 0.0), r"min_gain 0.0 for round 1, but its gate \(at line 4 .*\) judged "
                                                r"with min_gain 1.0"),
    ("schema1/gated_skip", ("config", "min_gain", 0.5), r"min_gain 0.5 for round 1, but its gate .*judged with "
                                                        r"min_gain 1.0"),
    ("happy", ("config", "policy", "balanced"), r"policy 'balanced' for round 1, but its plan [0-9a-f]{16} "
                                                r"\(loaded at line 4 .*\) was made with 'deepseek'"),
    ("happy", ("topology", "ep_size", 8), r"topology .*'ep_size': 8.* is not its configuration's"),
    ("happy", ("config", "num_layers", 4), r"topology .*'num_layers': 3.* is not its configuration's"),
    ("cordoned_http", ("config", "cordoned", False), r"is not cordoned, but the cluster commit \S+ of round 1 was "
                                                     r"requested by http"),
])
def test_an_edited_header_setting_fails_at_line_1(recording, edit, reason, tmp_path, capsys):
    lines = lines_of(recording)
    part, name, value = edit
    lines[0][part][name] = value
    _replay_fails(capsys, _write(tmp_path, lines), r"error: line 1: the header's .*" + reason)


@pytest.mark.parametrize("recording,name,value,reason", [
    ("happy", "policy", "balanced", r"policy 'balanced' is not its configuration's 'deepseek' \(the policy at the "
                                    r"range's end\)"),
    ("schema1/gated_skip", "policy", "greedy", r"policy 'greedy' is not its configuration's"),
    # no config_changed note since the stream's first record: the version init-cluster wrote, 0
    ("happy", "version", 3, r"configuration is version 3, but the range starts at the cluster's first audit record "
                            r"\(init-cluster writes version 0\) and no config_changed note changed it since"),
])
def test_an_edited_top_level_policy_or_version_fails_at_line_1(recording, name, value, reason, tmp_path, capsys):
    lines = lines_of(recording)
    (lines[0]["config"] if name == "version" else lines[0])[name] = value
    _replay_fails(capsys, _write(tmp_path, lines), r"^error: line 1: the header's .*" + reason)


def test_the_cluster_id_and_incarnation_are_attested_by_no_record(tmp_path):
    """What docs/recordings.md says the self-contained replay cannot check: no record carries them."""
    lines = lines_of("happy")
    lines[0]["cluster"], lines[0]["config"]["incarnation"] = "another-cluster", "0" * 32
    assert main(["replay", str(_write(tmp_path, lines))]) == 0


@pytest.mark.parametrize("path", RECORDINGS + SCHEMA1, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_kept_recording_replays_its_header(path):
    report = replay_file(path)  # the header checks run at the end of the replay
    check_gates(report)


# ---- a recording with config_changed notes, exported from a real cluster ------------------------------------------
@pytest.fixture
def changed(redis_url, cluster_id, tmp_path):
    """A cluster whose min_gain went 0.0 -> 0.05 -> 0.2 (two audited notes), exported whole."""
    store = Store(redis_url, cluster_id)
    cfg = ClusterConfig(num_layers=2, num_logical_experts=8, num_physical_experts=10, ep_size=2)
    init_cluster(store, cfg, initial_placement(2, 8, 10).phy2log)
    try:
        store.change_config({"min_gain": 0.05}, actor="test", reason="first")
        store.change_config({"min_gain": 0.2, "deadlines": {"commit_ms": 30_000}}, actor="test", reason="second")
        path = tmp_path / "changed.jsonl"
        export_recording(store, path)
        yield store, path
    finally:
        store.delete_cluster()


def test_the_header_is_the_configuration_after_the_last_note(changed, tmp_path, capsys):
    store, path = changed
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["range"]["round"] is None and lines[0]["config"]["min_gain"] == 0.2 and lines[0]["config"]["version"] == 2
    report = replay_file(path)
    assert [n.changes for n in report.config_changes] == [
        {"min_gain": [0.0, 0.05]}, {"min_gain": [0.05, 0.2], "deadlines.commit_ms": [600_000, 30_000]}]
    from fdeplb.replay.header_checks import configs

    timeline = configs(report)  # where the range starts: both notes undone
    assert (timeline.start.min_gain, timeline.start.deadlines.commit_ms, timeline.start.version) == (0.0, 600_000, 0)
    lines[0]["config"]["min_gain"] = 0.9
    _replay_fails(capsys, _write(tmp_path, lines), r"error: line 1: the header's configuration has min_gain 0.9, "
                                                   r"but the config_changed note at line 3 .* set it to 0.2")
    lines[0]["config"]["min_gain"], lines[0]["config"]["deadlines"]["commit_ms"] = 0.2, 600_000
    _replay_fails(capsys, _write(tmp_path, lines), r"error: line 1: .* deadlines.commit_ms 600000, but the "
                                                   r"config_changed note at line 3 .* set it to 30000")
    lines[0]["config"]["deadlines"]["commit_ms"], lines[0]["config"]["version"] = 30_000, 7
    _replay_fails(capsys, _write(tmp_path, lines), r"error: line 1: the header's configuration is version 7, but "
                                                   r"the config_changed note at line 3 .* made version 2")


def test_a_range_export_writes_the_configuration_at_its_end(changed):
    store, _ = changed
    config, entries = store.read_config(fresh=True), list(store.iter_audit())
    at_first = config_before(config, entries[1:])  # a range ending at the first note
    assert (at_first.min_gain, at_first.deadlines.commit_ms, at_first.version) == (0.05, 600_000, 1)
    assert config_before(config, []) == config


def test_a_round_export_is_held_to_the_notes_only_for_its_rounds(changed, tmp_path):
    """A round's export written before issue 34 holds the configuration at the export, which may be later than its
    range's end: its settings are not held to the notes, but each round still gets the notes' values."""
    _, path = changed
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    lines[0]["range"]["round"], lines[0]["config"]["min_gain"] = 0, 0.7
    report = replay_file(_write(tmp_path, lines))
    from fdeplb.replay.header_checks import configs

    assert configs(report).at(1).min_gain == 0.2 and configs(report).start.min_gain == 0.0


def test_a_corrupt_config_note_names_its_line(changed, tmp_path):
    _, path = changed
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    lines[1]["detail"] = json.dumps({"changes": {"min_gain": 0.05}, "version": 1})
    with pytest.raises(ReplayError, match=r"line 2 .*config_changed detail is not what the note carries"):
        replay_file(_write(tmp_path, lines))


def test_a_header_setting_no_record_shows_is_caught_against_the_live_cluster(changed, tmp_path, capsys):
    store, path = changed
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    lines[0]["config"]["retain_rounds"] = 99  # no record attests it: the self-contained replay cannot see it
    edited = _write(tmp_path, lines)
    assert main(["replay", str(edited)]) == 0
    live = ["--redis-url", store.url, "--cluster", store.cluster]
    incarnation = lines[0]["config"]["incarnation"]
    lines[0]["config"]["retain_rounds"], lines[0]["config"]["incarnation"] = 3, "f" * 32  # nor this one
    _replay_fails(capsys, [str(_write(tmp_path, lines, "reborn.jsonl")), *live],
                  rf"error: line 1: .*differs from the live cluster's .*: incarnation 'f{{32}}' \(live "
                  rf"'{incarnation}'\)")
    _replay_fails(capsys, [str(edited), *live],
                  r"error: line 1: the header's configuration differs from the live cluster's at the recording's "
                  r"end: retain_rounds 99 \(live 3\)")
    store.change_config({"min_gain": 0.3}, actor="test")  # the cluster goes on after the export
    assert main(["replay", str(path), *live]) == 0  # the genuine recording: the live notes after it undone
    capsys.readouterr()
    _replay_fails(capsys, [str(edited), *live], r"retain_rounds 99 \(live 3\)")


def test_an_export_racing_a_config_change_reads_both_again(changed, tmp_path, monkeypatch):
    store, _ = changed
    reads = []
    real = store.iter_audit

    def audit_then_change():
        reads.append(1)
        if len(reads) == 1:  # a `config set` lands between the configuration and the audit read
            store.change_config({"min_gain": 0.4}, actor="race")
        return real()

    monkeypatch.setattr(store, "iter_audit", audit_then_change)
    path = tmp_path / "raced.jsonl"
    export_recording(store, path)
    header = json.loads(path.read_text().splitlines()[0])
    assert len(reads) == 2 and header["config"]["min_gain"] == 0.4 and header["config"]["version"] == 3
    replay_file(path)  # the header is the last note's configuration: it replays

    def always_changing():  # a change between every pair of reads: the export gives up, writing nothing
        store.change_config({"retain_rounds": store.read_config(fresh=True).retain_rounds + 1}, actor="race")
        return real()

    monkeypatch.setattr(store, "iter_audit", always_changing)
    with pytest.raises(InputError, match="its configuration changed during each of 3 exports"):
        export_recording(store, tmp_path / "never.jsonl")
    assert not (tmp_path / "never.jsonl").exists()
