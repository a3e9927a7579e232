"""The Dagster UI in a real browser: materialize the core pipeline from the asset graph, see the plan's metadata."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SHOT_DIR = ROOT / "out" / "ui"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                 reason="needs Debian's chromium (apt-get install chromium); .ci/run installs it")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mark_nux_seen(url: str) -> None:
    """Tell the webserver the first-visit newsletter dialog was seen; it otherwise opens a second after load."""
    body = json.dumps({"query": "mutation { setNuxSeen }"}).encode()
    request = urllib.request.Request(f"{url}/graphql", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert json.load(response)["data"]["setNuxSeen"]


def _wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout_s}s")


@pytest.fixture
def dagster_dev(tmp_path):
    port = _free_port()
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "CORAL_DB": str(tmp_path / "coral.duckdb")}
    (tmp_path / "home").mkdir()
    dagster = Path(sys.executable).with_name("dagster")
    proc = subprocess.Popen([str(dagster), "dev", "-h", "127.0.0.1", "-p", str(port)], cwd=ROOT, env=env,
                            stdout=open(tmp_path / "dagster.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        _wait_http(f"http://127.0.0.1:{port}/server_info", 180)
        _mark_nux_seen(f"http://127.0.0.1:{port}")
        yield f"http://127.0.0.1:{port}", tmp_path
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_materialize_core_pipeline_from_the_ui(dagster_dev):
    from playwright.sync_api import sync_playwright

    from coral_dagster.store import Store

    url, tmp = dagster_dev
    SHOT_DIR.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        try:
            page.goto(f"{url}/asset-groups", wait_until="networkidle")
            page.get_by_role("button", name="Materialize all").wait_for()
            page.wait_for_timeout(2000)  # the newsletter dialog, were it still due, opens a second after load
            assert not page.locator(".bp5-overlay-backdrop").count(), "a dialog covers the asset graph"
            for group in ("catalog", "market", "profiling", "templates", "planning", "simulation", "deployment"):
                assert page.get_by_text(group, exact=True).first.is_visible()
            page.get_by_role("button", name="Materialize all").click()
            page.get_by_role("button", name="All", exact=True).click()
            page.get_by_role("button", name="Launch backfill").click()
            deadline, text = time.monotonic() + 600, ""
            while time.monotonic() < deadline:
                page.goto(f"{url}/assets/allocation_plan", wait_until="networkidle")
                page.wait_for_timeout(2000)
                text = page.inner_text("body")
                if "cost_usd_per_hour" in text and "plan_id" in text:
                    break
                time.sleep(5)
            page.screenshot(path=str(SHOT_DIR / "allocation_plan.png"), full_page=True)
        finally:
            browser.close()
    assert "cost_usd_per_hour" in text, (tmp / "dagster.log").read_text()[-3000:]
    store = Store(tmp / "coral.duckdb")
    plan = store.query("SELECT * FROM plans WHERE method = 'coral'")
    assert len(plan) == 1
    assert plan["plan_id"][0] in text  # the UI shows the plan the run stored
    served = set(store.query("SELECT DISTINCT model FROM plan_instances WHERE plan_id = ?",
                             [plan["plan_id"][0]])["model"])
    assert served == {"qwen3-32b", "gpt-oss-20b", "phi-4"}
