"""The web view in a real browser: Debian's Chromium, headless, driven by Playwright (no browser download), against
a real cluster (embedded Redis, a sim worker process for rank 0 and agents in threads for ranks 1..31, a coordinator,
a real `fdeplb serve` process) and against `fdeplb replay --ui` players of tests/replays/.

Every wait is on the page's DOM (the DOM contract: data-machine / data-state / aria-current on the drawn states,
data-rank / data-state / data-weights / data-membership on rank cells, data-audit-id on audit rows) with a deadline.
Screenshots go to the test's tmp folder, and also to FDEPLB_UI_SCREENSHOTS when set (how docs/ui-*.png are made).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import requests

from fdeplb.machines.tables import RANK
from fdeplb.status import commit_command

CHROMIUM = Path("/usr/bin/chromium")

pytestmark = [
    pytest.mark.browser, pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium "
                       "(apt-get install chromium chromium-driver; .ci/run installs it)"),
]

ROOT = Path(__file__).resolve().parents[2]
REPLAYS = ROOT / "tests" / "replays"
EP_SIZE = 32
LIFECYCLE = ["FREE", "COLLECTING", "PLANNING", "LOADING", "LOAD_SUCC", "SWAPPING", "DONE", "FREE"]
DEADLINE_MS = 20_000  # every DOM wait


def _screenshot(page, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    out = os.environ.get("FDEPLB_UI_SCREENSHOTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(out) / name)
    assert path.stat().st_size > 10_000
    return path


@pytest.fixture(scope="module")
def browser():
    # pages open with bypass_csp: Playwright's wait_for_function evaluates strings, which the page's CSP (no eval)
    # refuses; the CSP header itself is checked in test_ui_api.py
    """The system Chromium, headless (Playwright's launch gives it a fresh temporary profile, its own
    user-data-dir, removed at close)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"])
        try:
            yield chromium
        finally:
            chromium.close()


def _current(page, machine: str) -> list[str]:
    return page.eval_on_selector_all(f'g[data-machine="{machine}"][data-state][aria-current="true"]',
                                     "els => els.map(e => e.dataset.state)")


@pytest.fixture
def live_cluster(redis_url, cluster_id, tmp_path):
    """32 ranks over the bundled DeepSeek-V3 dump (58 layers x 256 experts, 32 redundant), cordoned (the round
    waits in LOAD_SUCC for the API's commit: the mid-round view holds still), and `fdeplb serve` on loopback."""
    from fdeplb.data import extract_bundled_trace
    from fdeplb.placement import read_expert_load
    from fdeplb.sim import LocalCluster, rank_share
    from tests.api_helpers import PASSWORD, USER, free_port, wait_http
    from tests.helpers import thread_cluster

    trace = extract_bundled_trace(tmp_path / "trace")
    total = read_expert_load(trace).expert_load
    with thread_cluster(redis_url, cluster_id, tmp_path, num_layers=total.shape[0], num_experts=total.shape[1],
                        num_redundant=EP_SIZE, ep_size=EP_SIZE, cordoned=True) as tc:
        tc.loads = np.stack([rank_share(total, r, EP_SIZE, 0) for r in range(EP_SIZE)])
        store = tc.store()
        sim = LocalCluster(store=store, redis_url=redis_url, config=tc.config, trace=str(trace), workdir=tmp_path,
                           backend="numpy")
        cursor = store.cursor(events_from="0-0")
        sim.start_rank(0, "--api-address", "10.9.0.0:8000", "--heartbeat-ttl-ms", "1500")
        tc.start_agents(range(1, EP_SIZE))
        tc.start_coordinator()
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "FDEPLB_API_USER": USER, "FDEPLB_API_PASSWORD": PASSWORD}
        serve = subprocess.Popen([sys.executable, "-m", "fdeplb", "serve", "--redis-url", redis_url, "--cluster",
                                  cluster_id, "--port", str(port), "--log-level", "WARNING"], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            sim.wait_ready([0], timeout_s=60, after=cursor)
            url = f"http://127.0.0.1:{port}"
            wait_http(url, proc=serve)
            yield url, sim, store
        finally:
            serve.terminate()
            serve.wait(timeout=30)
            sim.stop()


def test_live_view_follows_a_round_marks_a_stale_rank_and_links_the_audit_to_the_diagram(browser, live_cluster,
                                                                                        tmp_path):
    from tests.api_helpers import AUTH, CREDS, PASSWORD, USER

    url, sim, store = live_cluster
    assert requests.get(f"{url}/ui", timeout=10).status_code == 401  # a browser is asked for credentials
    page = browser.new_page(bypass_csp=True, http_credentials={"username": USER, "password": PASSWORD},
                            viewport={"width": 1600, "height": 1000})
    try:
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(f"{url}/ui")
        page.wait_for_selector('g[data-machine="cluster"][data-state="FREE"][aria-current="true"]',
                               timeout=DEADLINE_MS)
        page.wait_for_function(f"document.querySelectorAll('.cell[data-rank]').length === {EP_SIZE}",
                               timeout=DEADLINE_MS)
        assert page.get_attribute('.cell[data-rank="5"]', "data-state") == "IDLE"
        assert page.get_attribute('.cell[data-rank="5"]', "data-weights") == "NORMAL"
        assert page.get_attribute('.cell[data-rank="5"]', "data-membership") == "ACTIVE"
        page.evaluate("""() => {  // every cluster state the page highlights, in order, as it highlights it
            window.__seen = ['FREE'];
            new MutationObserver(() => {
                const cur = document.querySelector('g[data-machine="cluster"][data-state][aria-current="true"]');
                if (cur && window.__seen[window.__seen.length - 1] !== cur.dataset.state)
                    window.__seen.push(cur.dataset.state);
            }).observe(document.getElementById('machines'), {subtree: true, attributes: true,
                                                            attributeFilter: ['aria-current']});
        }""")
        reply = requests.post(f"{url}/rearrange_experts", json={**CREDS, "ips": ["10.9.0.0:8000"]}, timeout=30)
        assert reply.status_code == 200, reply.text
        # cordoned: the round waits in LOAD_SUCC with every rank LOADED: the mid-round view
        page.wait_for_selector('g[data-machine="cluster"][data-state="LOAD_SUCC"][aria-current="true"]',
                               timeout=DEADLINE_MS)
        page.wait_for_function(f"document.querySelectorAll('.cell[data-state=\"LOADED\"]').length === {EP_SIZE}",
                               timeout=DEADLINE_MS)
        page.wait_for_selector("#plan canvas", timeout=DEADLINE_MS)
        page.wait_for_selector('g.edge[data-machine="cluster"][data-trigger="loaded"][data-last="true"]',
                               timeout=DEADLINE_MS)
        assert page.text_content("#s-round") == "1"
        # cordoned: the page says the round waits for an operator's commit, and the command that gives it
        page.wait_for_selector('#notices [data-notice="waiting"]', timeout=DEADLINE_MS)
        plan_id = store.read_cluster().plan_id
        assert page.text_content("#commit-command") == commit_command(store.url, store.cluster, plan_id)
        assert page.is_visible("#s-cordoned") and f"plan {plan_id}" in page.text_content("#notices")
        _screenshot(page, tmp_path, "ui-live.png")
        reply = requests.post(f"{url}/rearrange_experts", json={**CREDS, "action": "update_weight_from_tensor"},
                              timeout=30)
        assert reply.status_code == 200, reply.text
        page.wait_for_function("window.__seen.length > 2 && window.__seen[window.__seen.length - 1] === 'FREE'",
                               timeout=DEADLINE_MS)
        seen = page.evaluate("window.__seen")
        it = iter(LIFECYCLE)
        assert all(state in it for state in seen), f"highlighted out of lifecycle order: {seen}"
        assert "LOAD_SUCC" in seen and seen[-1] == "FREE" and len(seen) >= 3, seen
        assert _current(page, "cluster") == ["FREE"]
        page.wait_for_selector('#timeline [data-round="1"]', timeout=DEADLINE_MS)
        assert page.query_selector('#notices [data-notice="waiting"]') is None  # committed: nothing waits
        lanes = page.eval_on_selector_all('#timeline [data-round="1"] text[data-lane-rank]',
                                          "els => els.map(e => e.textContent)")
        assert lanes[:2] == ["0", "2"] and len(lanes) == EP_SIZE // 2  # 32 lanes: every second one labelled

        # a rank's worker killed: its cell shows stale within its heartbeat TTL (1.5 s)
        sim.kill_rank(0)
        page.wait_for_selector('.cell[data-rank="0"][data-stale="true"]', timeout=DEADLINE_MS)
        assert page.get_attribute('.cell[data-rank="1"]', "data-stale") == "false"

        # an audit row chosen: its transition is highlighted in the diagram and its moment on the timeline
        row = page.wait_for_selector('#audit tbody tr[data-machine-row="cluster"]:has(td:text-is("commit"))',
                                     timeout=DEADLINE_MS)
        audit_id = row.get_attribute("data-audit-id")
        page.click(f'#audit tbody tr[data-audit-id="{audit_id}"]')  # the table is redrawn as records come
        page.wait_for_selector('g.edge[data-machine="cluster"][data-from="LOAD_SUCC"][data-trigger="commit"]'
                               '[data-selected="true"]', timeout=DEADLINE_MS)
        assert page.get_attribute(f'#audit tr[data-audit-id="{audit_id}"]', "aria-selected") == "true"
        page.wait_for_selector(f'#timeline line[data-moment="{audit_id}"]', state="attached", timeout=DEADLINE_MS)
        assert store.read_cluster().round == 1

        # a rank's reason is an agent's error text, shown as text: markup in it is never run
        evil = '<img src=x onerror="window.__xss=1">'
        store.update(RANK, 2, reason=evil)
        page.wait_for_function(f"ui.view && ui.view.ranks[2].reason === {evil!r}", timeout=DEADLINE_MS)
        page.hover('.cell[data-rank="1"]')
        page.hover('.cell[data-rank="2"]')
        page.wait_for_function(f"document.querySelector('#tip').textContent.includes({evil!r})",
                               timeout=DEADLINE_MS)
        assert page.evaluate("window.__xss") is None and page.query_selector("#tip img") is None
        assert not errors, errors
        assert requests.get(f"{url}/v1/ui/view", auth=AUTH, timeout=10).json()["counts"]["stale"] >= 1
    finally:
        page.close()


def _player(path: Path) -> tuple[subprocess.Popen, str]:
    """`fdeplb replay --ui PATH --port 0` and the URL it prints."""
    proc = subprocess.Popen([sys.executable, "-m", "fdeplb", "replay", "--ui", str(path), "--port", "0"],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # ends when the process does: a player that fails to start fails here
        if line.startswith("open http://"):
            return proc, line.split()[1]
    proc.wait(timeout=10)
    raise AssertionError(f"the player did not start (exit {proc.returncode})")


def test_player_steps_through_every_recording_to_its_final_state_and_marks_a_failed_check(browser, tmp_path):
    from fdeplb.ui import PlayerModel

    recordings = sorted(REPLAYS.glob("*.jsonl"))
    bad = tmp_path / "forged.jsonl"  # happy.jsonl with one record's to-state changed: the replay fails there
    lines = (REPLAYS / "happy.jsonl").read_text().splitlines()
    lines[8] = lines[8].replace('"to":"LOADED"', '"to":"SWAPPED"')
    bad.write_text("\n".join(lines) + "\n")
    page = browser.new_page(bypass_csp=True, viewport={"width": 1600, "height": 1000})
    try:
        for path in [*recordings, bad]:
            proc, url = _player(path)
            try:
                page.goto(url)
                page.wait_for_selector("#player:not([hidden]) #slider", timeout=DEADLINE_MS)
                steps = int(page.get_attribute("#slider", "max"))
                expected = PlayerModel(path)
                page.fill("#slider", "0")  # the start of the recording, then next, record by record
                page.wait_for_function("document.querySelector('#step-label').textContent.startsWith('record 0 ')",
                                       timeout=DEADLINE_MS)
                states = [_current(page, "cluster")]
                for step in range(1, steps + 1):
                    page.click("#next")
                    page.wait_for_function(f"document.querySelector('#step-label').textContent"
                                           f".startsWith('record {step} ')", timeout=DEADLINE_MS)
                    states.append(_current(page, "cluster"))
                    assert states[-1] == [expected.view(str(step))["summary"]["state"]], (path.name, step)
                assert page.is_disabled("#next")
                if path.name == "happy.jsonl":
                    assert states[-1] == ["FREE"]  # stepping to the last record shows FREE
                    assert {"COLLECTING", "LOADING", "SWAPPING", "DONE"} <= {s for s, *_ in states}
                    page.fill("#slider", "15")
                    page.wait_for_selector('g[data-machine="cluster"][data-state="SWAPPING"][aria-current="true"]',
                                           timeout=DEADLINE_MS)
                    page.wait_for_selector('#audit tr.at-step', timeout=DEADLINE_MS)
                    _screenshot(page, tmp_path, "ui-player.png")
                failed = page.eval_on_selector_all('#audit tr[data-check="failed"]', "els => els.length")
                if path == bad:
                    assert failed == 1 and page.get_attribute("#checks-summary", "data-ok") == "false"
                    assert page.query_selector("#fail-ticks i[data-failed-step]") is not None
                    step = int(page.get_attribute('#audit tr[data-check="failed"]', "data-step"))
                    page.click('#audit tr[data-check="failed"]')
                    page.wait_for_selector('#record-check[data-check="failed"]', timeout=DEADLINE_MS)
                    assert "line 9" in page.text_content("#record-check") and step == 8
                else:
                    assert failed == 0 and page.get_attribute("#checks-summary", "data-ok") == "true", path.name
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    finally:
        page.close()


def test_the_page_says_when_the_records_are_gone_and_when_the_cluster_was_made_anew(browser, redis_url, cluster_id,
                                                                                    tmp_path):
    """A real `fdeplb serve` over a cluster whose records are then deleted (as Redis restarted empty) and created
    again (`init-cluster`): the page says each plainly instead of drawing the old or a fresh FREE round 0."""
    from fdeplb.orchestration.cluster_setup import init_cluster
    from fdeplb.placement import initial_placement
    from fdeplb.store import ClusterConfig, Store
    from tests.api_helpers import PASSWORD, USER, free_port, wait_http

    store = Store(redis_url, cluster_id)
    cfg = ClusterConfig(num_layers=2, num_logical_experts=8, num_physical_experts=12, ep_size=4)
    init_cluster(store, cfg, initial_placement(2, 8, 12).phy2log)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FDEPLB_API_USER": USER, "FDEPLB_API_PASSWORD": PASSWORD}
    serve = subprocess.Popen([sys.executable, "-m", "fdeplb", "serve", "--redis-url", redis_url, "--cluster",
                              cluster_id, "--port", str(port), "--log-level", "WARNING"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    page = browser.new_page(bypass_csp=True, http_credentials={"username": USER, "password": PASSWORD},
                            viewport={"width": 1600, "height": 1000})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url, proc=serve)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(f"{url}/ui")
        page.wait_for_selector('g[data-machine="cluster"][data-state="FREE"][aria-current="true"]',
                               timeout=DEADLINE_MS)
        assert page.query_selector("#notices [data-notice]") is None
        store.delete_cluster()
        page.wait_for_selector('#notices [data-notice="gone"]', timeout=DEADLINE_MS)
        text = page.text_content("#notices")
        assert f"Redis holds no records of cluster {cluster_id}" in text and "last seen in round 0, FREE v0" in text
        assert page.text_content("#s-state") == "no records" and _current(page, "cluster") == []
        assert page.eval_on_selector_all(".cell[data-rank]", "els => els.length") == 0
        _screenshot(page, tmp_path, "ui-gone.png")
        init_cluster(store, cfg, initial_placement(2, 8, 12).phy2log)
        page.wait_for_selector('#notices [data-notice="recreated"]', timeout=DEADLINE_MS)
        assert page.query_selector('#notices [data-notice="gone"]') is None
        assert "was created anew" in page.text_content("#notices")
        page.wait_for_selector('g[data-machine="cluster"][data-state="FREE"][aria-current="true"]',
                               timeout=DEADLINE_MS)
        _screenshot(page, tmp_path, "ui-recreated.png")
        assert not errors, errors
    finally:
        page.close()
        serve.terminate()
        serve.wait(timeout=30)
        store.delete_cluster()


def test_the_player_shows_a_cordoned_round_waiting_and_labels_each_rank_lane(browser, tmp_path):
    from fdeplb.ui import PlayerModel

    path = REPLAYS / "cordoned_http.jsonl"
    expected = PlayerModel(path)
    step = next(s for s in range(len(expected.records) + 1) if expected.view(str(s))["waiting"])
    proc, url = _player(path)
    page = browser.new_page(bypass_csp=True, viewport={"width": 1600, "height": 1000})
    try:
        page.goto(url)
        page.wait_for_selector("#player:not([hidden]) #slider", timeout=DEADLINE_MS)
        page.fill("#slider", str(step))
        page.wait_for_selector('#notices [data-notice="waiting"]', timeout=DEADLINE_MS)
        assert page.text_content("#commit-command") == expected.view(str(step))["waiting"]["command"]
        assert page.is_visible("#s-cordoned")
        lanes = page.eval_on_selector_all('#timeline text[data-lane-rank]', "els => els.map(e => e.textContent)")
        assert lanes == ["rank 0", "rank 1"]
        _screenshot(page, tmp_path, "ui-player-waiting.png")
        page.click("#next")  # the commit: nothing waits any more
        page.wait_for_function("!document.querySelector('#notices [data-notice=\"waiting\"]')", timeout=DEADLINE_MS)
    finally:
        page.close()
        proc.terminate()
        proc.wait(timeout=30)
