"""Run a scenario through a simulated day with one method, and keep the result in the store (`day_runs`,
`day_windows`) beside a timeline plot: the use case `coral day` and `bench.day` call."""

from __future__ import annotations

import logging
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

import pandas as pd

from coral_dagster.allocation.types import Plan
from coral_dagster.app.make_plan import solve_once
from coral_dagster.app.scenario_plans import library_templates
from coral_dagster.catalog.market import MarketSnapshot
from coral_dagster.catalog.scenarios import Scenario, load_scenario
from coral_dagster.day.loop import DayLoop, DayResult, WindowRow
from coral_dagster.day.serve import SERVE_MODES
from coral_dagster.day.shape import SIZINGS, day_spec, peak_rates, window_count
from coral_dagster.day.spot import spot_prices
from coral_dagster.day.windows import WindowInputs, write_inputs
from coral_dagster.errors import CoralError, SolverTimeoutError, UnknownNameError
from coral_dagster.highs import DEFAULT_MAX_NODES
from coral_dagster.store import Store
from coral_dagster.store.duck import write_frame
from coral_dagster.templates.types import Template

DAY_METHODS = ("coral", "homo-ilp", "cauchy", "static-peak")
log = logging.getLogger(__name__)


def method_planner(scenario: Scenario, templates: Sequence[Template], method: str, *, time_limit_s: float,
                   max_nodes: int | None = DEFAULT_MAX_NODES) -> Callable[[Mapping[str, float], MarketSnapshot,
                                                                        Plan | None], Plan]:
    """The re-plan of one window: `method` on the window's rates and market, churn priced against the running
    plan; where the market cannot carry the demand, the plan serves the largest share it can (scarcity `scale`).
    A re-plan that finds no plan within its limits keeps the running plan (the next window tries again)."""
    def solve(rates: Mapping[str, float], market: MarketSnapshot, running: Plan | None) -> Plan:
        try:
            return solve_once(scenario, method, templates, market, rates, running=running,
                              time_limit_s=time_limit_s, max_nodes=max_nodes)
        except SolverTimeoutError:
            raise
        except CoralError:
            return solve_once(scenario, method, templates, market, rates, running=running, scarcity="scale",
                              time_limit_s=time_limit_s, max_nodes=max_nodes)

    def plan(rates: Mapping[str, float], market: MarketSnapshot, running: Plan | None) -> Plan:
        try:
            return solve(rates, market, running)
        except SolverTimeoutError as exc:
            if running is None:
                raise
            log.warning("%s re-plan found no plan within its limits; the running plan %s stays (%s)", method,
                        running.plan_id, exc.problem)
            return running

    return plan


def run_day(scenario: str | Scenario, method: str = "coral", *, hours: float = 24.0, db_path: str | None = None,
            failure_rate: float = 0.0, seed: int = 0, time_limit_s: float | None = None,
            templates: Sequence[Template] | None = None, store_result: bool = True,
            progress: Callable[[WindowRow], None] | None = None, serve: str = "fluid",
            sizing: str = "forecast", prices_path: str | None = None, keep_segments: bool = False,
            spot: bool | None = None) -> DayResult:
    """Simulate `hours` of the scenario's day with `method` (`static-peak`: Coral's plan for the day's peak rates,
    run all day); the reconciler's records go to a scratch DuckDB file (never the store's own deployment), the
    result to the store's `day_runs` and `day_windows` in one transaction. `serve`: "fluid" estimates each window's
    serving from the capacity up; "requests" serves its traffic request by request (`day.serve`), slower.
    `sizing`: what each re-plan sizes for (`shape.SIZINGS`): a forecast over the start-up lead, or the window.
    `prices_path`: a price file (`--prices`) to plan and bill with instead of the bundled rows. `keep_segments`:
    store each window's serving inputs too (`day_segments`, `day.windows`), to serve the windows apart later.
    `spot`: run every node sold on spot there, at its spot price, preemptible (None: the scenario's `day: spot`)."""
    if method not in DAY_METHODS:
        raise UnknownNameError("day method", method, DAY_METHODS)
    if serve not in SERVE_MODES:
        raise UnknownNameError("serve mode", serve, SERVE_MODES)
    if sizing not in SIZINGS:
        raise UnknownNameError("sizing", sizing, SIZINGS)
    if not (0 < hours <= 24 * 7):
        raise CoralError(f"--hours {hours:g} is outside (0, 168].", "give the hours to simulate, e.g. --hours 24")
    scn = load_scenario(scenario) if isinstance(scenario, str) else scenario
    if spot is not None:
        scn = replace(scn, day=replace(day_spec(scn), spot=spot))
    if templates is None:
        templates = library_templates(scn, db_path)
    # Each re-plan: the re-plan path's work limit, under a wall-clock net of half the re-plan interval.
    limit = time_limit_s if time_limit_s is not None else scn.replan_interval_min * 30.0
    static = method == "static-peak"
    planner = method_planner(scn, templates, "coral" if static else method, time_limit_s=limit)
    from coral_dagster.app.prices import price_table
    from coral_dagster.catalog.prices import load_node_prices

    prices = price_table(prices_path)
    if prices is None:
        prices = load_node_prices()
    if day_spec(scn).spot:
        prices = spot_prices(prices)

    # The reconciler warns of every rolled-back launch; in a simulated day they are the windows' `nodes_failed`.
    quiet = logging.getLogger("coral_dagster.deploy.reconcile")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="coral-day-") as scratch:
        loop = DayLoop(scn, method, planner, Store(Path(scratch) / "deployment.duckdb"),
                       prices,
                       static_rates=peak_rates(scn, window_count(scn, hours)) if static else None,
                       failure_rate=failure_rate, seed=seed, serve_mode=serve, sizing=sizing,
                       keep_segments=keep_segments)
        try:
            result = loop.run(hours, progress)
        finally:
            quiet.setLevel(level)
    if store_result:
        store_day(Store(db_path), scn, result, loop.kept)
    return result


def store_day(store: Store, scenario: Scenario, result: DayResult, kept: Sequence[WindowInputs] = ()) -> str:
    """Append one day's run, its windows and the serving inputs `kept` of them (one transaction); returns the run
    id."""
    run_id = uuid.uuid4().hex[:12]
    summary = result.as_dict()
    run = pd.DataFrame([{"run_id": run_id, "scenario": scenario.name, "scenario_key": scenario.scenario_key,
                         "method": result.method, "serve_mode": result.serve_mode, "sizing": result.sizing,
                         "spot": day_spec(scenario).spot,
                         "hours": result.hours,
                         "replan_interval_min": result.replan_interval_min, "cost_usd": result.cost_usd,
                         "slo_tokens": result.slo_tokens,
                         "usd_per_million_slo_tokens": result.usd_per_million_slo_tokens,
                         "worst_window": summary["worst_window"]["window"],
                         "worst_attainment": summary["worst_window"]["worst_attainment"],
                         "max_replan_s": summary["max_replan_s"], "created_at": pd.Timestamp.now(tz="UTC")}])
    windows = pd.DataFrame([{"run_id": run_id, **row} for row in summary["windows"]])
    with store.transaction() as con:
        write_frame(con, "day_runs", run)
        write_frame(con, "day_windows", windows)
        write_inputs(con, run_id, kept)
    return run_id


def write_timeline(results: Sequence[DayResult], path: str | Path) -> Path:
    """The timeline plot of one or more methods' days, as a PNG file."""
    from coral_dagster.day.plot import timeline_png

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(timeline_png(results))
    return out
