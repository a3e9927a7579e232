"""The Dagster UI in a real browser, on the instance `coral run` records into: a blocked deployment, a template
partition materialized from the UI, and the sensor requesting a re-plan."""

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
from collections import Counter
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
    # The sensor's preview decides tripled demand from the plan alone (about 1 s); the raised sensor call timeout
    # only keeps a loaded CI machine from failing a tick, as README "Dagster" tells users on busy cores.
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "CORAL_DB": str(tmp_path / "coral.duckdb"),
           "DAGSTER_SENSOR_GRPC_TIMEOUT_SECONDS": "600"}
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


def _browser(p):
    return p.chromium.launch(executable_path=CHROMIUM, args=[
        "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"])


def _partition_materializations(home: Path) -> Counter:
    import dagster as dg

    with dg.DagsterInstance.from_config(str(home)) as instance:
        records = instance.fetch_materializations(dg.AssetKey("template_library"), limit=1000).records
    return Counter(r.partition_key for r in records)


def test_coral_run_shows_in_the_ui_which_materializes_a_partition_previews_a_replan_and_shows_a_blocked_deploy(
        dagster_dev, monkeypatch):
    """`coral run`'s pipeline recorded in the instance `dagster dev` serves: its blocked deployment is visible; one
    template partition is materialized from the UI; the sensor's preview requests a re-plan of the scenario."""
    from playwright.sync_api import sync_playwright

    from coral_dagster.app.rounds import store_demand
    from coral_dagster.catalog.scenarios import load_scenario
    from coral_dagster.definitions import materialize_pipeline
    from coral_dagster.store import Store

    url, tmp = dagster_dev
    monkeypatch.setenv("DAGSTER_HOME", str(tmp / "home"))
    monkeypatch.setenv("CORAL_DB", str(tmp / "coral.duckdb"))
    # Ten times the planned demand: more than any model's instances can serve (a plan sized for the traces' bursts
    # may carry three times its demand for 30 s with every request within SLO: core's did on 2026-12-06, its
    # busiest model at 51% busy), so the blocking check has a model to block on.
    run = materialize_pipeline("core", simulate_s=30, attainment_target=1.0, rate_scale=10.0)
    store = Store(tmp / "coral.duckdb")
    plan_id = run.metadata["allocation_plan"]["plan_id"].value
    sim = store.query("SELECT model, attainment FROM simulations WHERE plan_id = ?", [plan_id])
    short = sim[sim["attainment"] < 1.0]
    assert not short.empty, "every model attained 100% at 10x its rate in 30 s: nothing for the check to block"
    assert run.not_materialized == ["deployment_specs"]

    SHOT_DIR.mkdir(parents=True, exist_ok=True)
    before = _partition_materializations(tmp / "home")
    with sync_playwright() as p:
        browser = _browser(p)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        try:
            # The blocking check failed on the plan it checked, and deployment_specs was not materialized.
            page.goto(f"{url}/assets/plan_simulation?view=checks", wait_until="networkidle")
            page.get_by_text("This is a blocking asset check.").wait_for(timeout=60_000)
            checks = page.inner_text("body")
            page.screenshot(path=str(SHOT_DIR / "blocking_check.png"))
            page.goto(f"{url}/assets/deployment_specs", wait_until="networkidle")
            page.get_by_text("Latest materialization").wait_for(timeout=60_000)
            page.wait_for_timeout(1000)
            deployment = page.inner_text("body")
            # The plan's cost plot, an inline PNG in markdown metadata, renders as an image.
            page.goto(f"{url}/assets/allocation_plan", wait_until="networkidle")
            page.get_by_text("[Show Markdown]").first.click()
            image = page.get_by_role("dialog").locator("img[alt='plan cost over time']")
            image.wait_for(timeout=60_000)
            image_width = image.evaluate("img => img.naturalWidth")
            page.keyboard.press("Escape")
            page.goto(f"{url}/runs", wait_until="networkidle")
            page.get_by_text(run.run_ids[-1][:8]).first.wait_for(timeout=60_000)
            runs = page.inner_text("body")

            # One template partition, materialized from the asset's Materialize dialog.
            page.goto(f"{url}/assets/template_library", wait_until="networkidle")
            page.get_by_role("button", name="Materialize").first.click()
            dialog = page.get_by_role("dialog")
            dialog.get_by_text("Select a partition or create one").click()
            page.keyboard.type("core/phi-4")
            page.locator("div[title='core/phi-4']").first.click()
            page.keyboard.press("Escape")
            dialog.get_by_role("button", name="Launch 1 run").click()
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and _partition_materializations(tmp / "home") == before:
                time.sleep(3)
            after = _partition_materializations(tmp / "home")

            # The sensor, previewed after demand tripled, requests `replan` with the scenario in its run config.
            scenario = load_scenario("core")
            store_demand(store, scenario, {m.model: 3 * m.rate_req_s for m in scenario.models}, "uniform")
            page.goto(f"{url}/locations/coral/sensors/reallocation_sensor", wait_until="networkidle")
            page.get_by_role("button", name="Preview tick result").click()
            page.get_by_role("dialog").get_by_role("button", name="Continue").click()
            page.get_by_text("Requested runs (1)").wait_for(timeout=180_000)
            page.get_by_role("dialog").get_by_role("button", name="Preview").click()
            page.get_by_text("Run configuration").wait_for(timeout=60_000)
            preview = "\n".join(d.inner_text() for d in page.get_by_role("dialog").all())
            page.screenshot(path=str(SHOT_DIR / "sensor_preview.png"))
        finally:
            browser.close()
    log = (tmp / "dagster.log").read_text()[-3000:]
    assert plan_id in checks and "Failed" in checks, log
    for row in short.itertuples():
        assert f"{row.model} served {row.attainment:.1%}" in checks
    assert f"Failed in\n{run.run_ids[-1][:8]}" in deployment and "No metadata found" in deployment, log
    assert all(run_id[:8] in runs for run_id in run.run_ids)
    assert image_width > 0
    assert after - before == Counter({"core/phi-4": 1}), log
    assert "Requested runs (1)" in preview and "coral/scenario: core" in preview
    assert "name: core" in preview  # the scenario resource's config, which every asset of the replan job reads
