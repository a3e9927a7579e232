"""Deployment asset: the newest plan as SkyPilot tasks, one per node, reconciled against what runs."""

import dagster as dg

from assets.config import ScenarioConfig
from resources.launcher import SkyPilotLauncher
from resources.store import CoralDuckDB


@dg.asset(group_name="deployment", kinds={"skypilot", "duckdb"}, deps=["allocation_plan"])
def deployment_specs(config: ScenarioConfig, duckdb: CoralDuckDB, launcher: SkyPilotLauncher) -> dg.MaterializeResult:
    """SkyPilot tasks for the newest Coral plan (written, or launched when the launcher is not a dry run)."""
    from coral_dagster.allocation.storage import load_plan

    store = duckdb.store()
    plan_id = store.query("SELECT plan_id FROM plan_history WHERE scenario = ? AND method = 'coral' "
                          "ORDER BY created_at DESC LIMIT 1", [config.scenario])["plan_id"].iloc[0]
    report = launcher.deploy(store, plan_id, load_plan(store, plan_id))
    commands = report.get("commands", [])
    return dg.MaterializeResult(metadata={
        "plan_id": plan_id,
        "report": dg.MetadataValue.json({k: v for k, v in report.items() if k != "commands"}),
        "commands": dg.MetadataValue.md("```sh\n" + "\n".join(commands[:40]) + "\n```"),
    })
