"""Deployment asset: the simulated and checked plan as SkyPilot tasks, one per node, reconciled against what runs."""

import dagster as dg

from assets.metadata import recorded_plan_id
from coral_dagster.errors import CoralError
from resources.launcher import SkyPilotLauncher
from resources.store import CoralDuckDB


@dg.asset(group_name="deployment", kinds={"skypilot", "duckdb"}, deps=["allocation_plan", "plan_simulation"])
def deployment_specs(context: dg.AssetExecutionContext, duckdb: CoralDuckDB,
                     launcher: SkyPilotLauncher) -> dg.MaterializeResult:
    """SkyPilot tasks for the plan `plan_simulation` simulated (and `allocation_plan` made), priced from its own
    market snapshot (written, or launched when the launcher is not a dry run); the deployment's full cost sits
    beside the plan's. Not materialized when `plan_meets_demand` or `slo_attainment_meets_target` (blocking checks
    upstream) fails."""
    from coral_dagster.allocation.storage import load_plan

    plan_id, planned = recorded_plan_id(context, "plan_simulation"), recorded_plan_id(context, "allocation_plan")
    if plan_id != planned:
        raise CoralError(f"plan_simulation checked plan {plan_id}, but allocation_plan has since made {planned}.",
                         "materialize plan_simulation again (the replan job does both), then deployment_specs.")
    store = duckdb.store()
    plan = load_plan(store, plan_id)
    report = launcher.deploy(store, plan).as_dict()
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
