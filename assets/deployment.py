"""Deployment asset: the newest plan as SkyPilot tasks, one per node, reconciled against what runs."""

import dagster as dg

from assets.config import ScenarioConfig
from resources.launcher import SkyPilotLauncher
from resources.store import CoralDuckDB


@dg.asset(group_name="deployment", kinds={"skypilot", "duckdb"}, deps=["allocation_plan", "plan_simulation"])
def deployment_specs(config: ScenarioConfig, duckdb: CoralDuckDB, launcher: SkyPilotLauncher) -> dg.MaterializeResult:
    """SkyPilot tasks for the scenario's latest Coral plan, priced from its own market snapshot (written, or launched
    when the launcher is not a dry run); the deployment's full cost sits beside the plan's. Not materialized when
    `plan_meets_demand` or `slo_attainment_meets_target` (blocking checks upstream) fails."""
    from coral_dagster.app.deployment import deploy
    from coral_dagster.app.plans import latest_plan

    store = duckdb.store()
    plan = latest_plan(store, config.scenario)
    report = deploy(store, plan, launcher)
    commands = report.get("commands", [])
    return dg.MaterializeResult(metadata={
        "plan_id": plan.plan_id,
        "plan_usd_per_hour": dg.MetadataValue.float(report["plan_usd_per_hour"]),
        **{k: dg.MetadataValue.float(float(report[k]))
           for k in ("total_usd_per_hour", "gpu_usd_per_hour", "cpu_usd_per_hour")},
        "clusters": dg.MetadataValue.int(report["clusters"]),
        "unpriced": dg.MetadataValue.md("\n".join(f"- {part}" for part in report["unpriced"]) or "nothing"),
        "report": dg.MetadataValue.json({k: v for k, v in report.items() if k != "commands"}),
        "commands": dg.MetadataValue.md("```sh\n" + "\n".join(commands[:40]) + "\n```"),
    })
