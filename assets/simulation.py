"""Simulation asset: the plan `allocation_plan` made, served request by request under the scenario's traces."""

import dagster as dg
from pydantic import Field

from assets.metadata import frame_table, recorded_plan_id, row_count
from resources.store import CoralDuckDB


class SimulationConfig(dg.Config):
    """How long and how the plan is simulated."""

    duration_s: float = Field(default=120.0, description="Seconds of traffic to simulate.")
    seed: int = Field(default=0, description="Seed of the arrival process.")
    attainment_target: float = Field(default=0.95, description="The SLO attainment the check requires.")
    rate_scale: float = Field(default=1.0, gt=0, description="Serve the traces at this multiple of their rates "
                                                           "(2 = twice the planned demand: what-if load).")


@dg.asset(group_name="simulation", kinds={"duckdb", "python"}, deps=["allocation_plan"])
def plan_simulation(context: dg.AssetExecutionContext, config: SimulationConfig,
                    duckdb: CoralDuckDB) -> dg.MaterializeResult:
    """TTFT, TPOT, SLO attainment and goodput per model of the plan `allocation_plan` recorded, appended to
    `simulations`."""
    from coral_dagster.app.simulation import simulate_plan_id
    from coral_dagster.plots import markdown_image

    store = duckdb.store()
    plan_id = recorded_plan_id(context, "allocation_plan")
    result, table = simulate_plan_id(store, plan_id, duration_s=config.duration_s, seed=config.seed,
                                     attainment_target=config.attainment_target, rate_scale=config.rate_scale)
    by_model = table.drop(columns=["plan_id", "simulated_at"]).round(3)
    return dg.MaterializeResult(metadata={
        "plan_id": plan_id,
        "attainment": dg.MetadataValue.float(round(result.attainment, 4)),
        "goodput_tokens_per_s": dg.MetadataValue.float(round(result.goodput_tokens_per_s, 1)),
        "by_model": frame_table(by_model),
        **row_count(len(by_model)),
        "latency_cdf": dg.MetadataValue.md(markdown_image(_cdf_png(result), "latency CDF")),
    })


@dg.asset_check(asset=plan_simulation, blocking=True,
                description="Simulated SLO attainment of every model meets the target; a failure stops deployment.")
def slo_attainment_meets_target(context: dg.AssetCheckExecutionContext, duckdb: CoralDuckDB) -> dg.AssetCheckResult:
    from coral_dagster.app.simulation import plan_simulation as simulated

    plan_id = recorded_plan_id(context, "plan_simulation")
    rows = simulated(duckdb.store(), plan_id)
    short = rows[rows["attainment"] < rows["attainment_target"]]
    if short.empty:
        description = f"every model of plan {plan_id} meets its SLO attainment target in simulation."
    else:
        description = f"plan {plan_id} misses its SLO attainment target in simulation: " + "; ".join(
            f"{r.model} served {r.attainment:.1%} of requests within SLO, below the {r.attainment_target:.0%} target"
            for r in short.itertuples()) + "."
    return dg.AssetCheckResult(passed=short.empty, description=description, metadata={
        "plan_id": plan_id,
        "below_target": dg.MetadataValue.json(dict(zip(short["model"], short["attainment"].round(4)))),
        "worst_attainment": dg.MetadataValue.float(float(rows["attainment"].min()))})


def _cdf_png(result) -> bytes:
    import tempfile
    from pathlib import Path

    from coral_dagster.simulator.plots import plot_latency_cdf

    with tempfile.TemporaryDirectory() as tmp:
        return plot_latency_cdf(result, Path(tmp) / "cdf.png").read_bytes()
