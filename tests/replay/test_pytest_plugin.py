"""The pytest plugin (``pytest --fdeplb-recordings DIR``, :mod:`fdeplb.replay.pytest_plugin`): every recording under
DIR is a test that replays it; a good one passes, a mutated one fails naming its record number and the reason;
without the option nothing is collected. Run in pytester's own folder (the plugin loads through its entry point)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.replay.helpers import HAPPY, REPLAYS, index_of, lines_of

pytest_plugins = ["pytester"]


def _recordings(pytester: pytest.Pytester, **files) -> None:
    """``name=lines`` (a list of dicts) written under ``recs/``, or ``name=path`` copied there."""
    for name, content in files.items():
        target = pytester.path / "recs" / f"{name}.jsonl"
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, list):
            target.write_text("\n".join(json.dumps(x) for x in content) + "\n")
        else:
            shutil.copy(content, target)


def test_a_good_recording_passes(pytester):
    _recordings(pytester, happy=HAPPY, **{"nested/stale_rank": REPLAYS / "stale_rank.jsonl"})
    result = pytester.runpytest("-p", "no:cacheprovider", "--fdeplb-recordings", "recs", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*recs/happy.jsonl::replay PASSED*", "*recs/nested/stale_rank.jsonl::replay PASSED*"])


def test_a_mutated_recording_fails_naming_its_record_and_reason(pytester):
    lines = lines_of()
    load = index_of(lines, key="cluster", trigger="load")  # line 4 of the file
    lines[load]["reason"] = "nothing to see"
    _recordings(pytester, happy=HAPPY, mutated=lines)
    result = pytester.runpytest("-p", "no:cacheprovider", "--fdeplb-recordings", "recs")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        f"recording *recs/mutated.jsonl: record {load + 1} (line {load + 1}) does not replay: line {load + 1} "
        f"(audit id {lines[load]['id']}): chain * this one was edited",
        "FAILED recs/mutated.jsonl::replay*"])
    assert "Traceback" not in result.stdout.str()  # the record and the reason, not a stack


def test_an_edited_header_fails_at_line_1(pytester):
    lines = lines_of()
    lines[0]["config"]["min_gain"] = 0.9  # its committed round 1 gained 0.56: that min_gain would have skipped it
    _recordings(pytester, edited=lines)
    result = pytester.runpytest("-p", "no:cacheprovider", "--fdeplb-recordings", "recs")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["recording *recs/edited.jsonl: *line 1: the header's configuration has min_gain 0.9 "
                                 "for round 1, but the round went on*which that min_gain skips*"])


def test_an_unreadable_recording_fails_saying_so(pytester):
    _recordings(pytester, empty=[])
    result = pytester.runpytest("-p", "no:cacheprovider", "--fdeplb-recordings", "recs")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["recording *recs/empty.jsonl: the recording does not replay: *no audit records*"])


def test_without_the_option_the_plugin_collects_nothing(pytester):
    _recordings(pytester, happy=HAPPY)
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED


def test_a_folder_that_is_not_there_is_a_usage_error(pytester):
    result = pytester.runpytest("-p", "no:cacheprovider", "--fdeplb-recordings", "nowhere")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--fdeplb-recordings nowhere: not a folder*"])


def test_recording_items_are_selected_like_tests(pytester):
    _recordings(pytester, happy=HAPPY, stale_rank=REPLAYS / "stale_rank.jsonl")
    result = pytester.runpytest("-p", "no:cacheprovider", "--fdeplb-recordings", "recs", "-k", "stale")
    result.assert_outcomes(passed=1)
