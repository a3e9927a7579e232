"""Coral through a day: each method re-plans, launches and serves a scenario's day (`coral day`), side by side.

Run: `python -m bench.day [--scenarios core,extended,large] [--hours 24] [--methods coral,homo-ilp,cauchy,static-peak]
[--scale extended=0.2] [--no-bursts] [--steady-supply] [--spot] [--peak-to-trough R] [--sizing forecast|window]
[--serve fluid|requests] [--db PATH]`; the store must hold each scenario's template library
(`coral templates build --scenario NAME`). `--scale NAME=F` runs scenario NAME at F × its request rates (e.g.
extended at a demand its market can serve most of the day); `--no-bursts` keeps the diurnal shape alone;
`--steady-supply` drops the availability series (every window sees the market profile: no scarcity cycle);
`--spot` runs every node sold on spot there, at its spot price, taken back when the series' supply falls below the
spot nodes held and preempted at random (DAY.md §4);
`--peak-to-trough R` replaces the day's diurnal ratio (DAY.md §2's assumption) to show which way the result moves;
`--serve requests` serves each window request by request in the simulator (`coral day --serve`) instead of the fluid
estimate. Each row carries `demand_peak_over_mean`, the most any re-planning method can save against static-peak
(the day's peak rate over its mean). Writes bench/results/day.json (headline rows) and one timeline plot per
scenario, bench/results/day_<scenario>.png (with `--out X.json`: X_<scenario>.png beside it), and prints a table.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench._results import RESULTS, write_result
from coral_dagster.app.processes import stop_on_sigterm
from coral_dagster.app.scenario_plans import library_templates
from coral_dagster.catalog.scenarios import Scenario, load_scenario
from coral_dagster.day.run import DAY_METHODS, run_day, write_timeline
from coral_dagster.day.shape import day_spec, peak_rates, window_count, window_rates
from coral_dagster.errors import CoralError

GOAL_X = 1.3  # Coral's advantage per SLO-met token the large-model scenario is meant to show
console = Console(width=160)


def scaled(scn: Scenario, factor: float) -> Scenario:
    """The scenario at `factor` × every model's request rate (its library is the same)."""
    return scn if factor == 1.0 else replace(scn, models=tuple(replace(m, rate_req_s=m.rate_req_s * factor)
                                                              for m in scn.models))


def _scales(text: str) -> dict[str, float]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            raise CoralError(f"--scale {part!r} is not NAME=FACTOR.", "write e.g. --scale extended=0.2") from None
    return out


def summary(result, replan_limit_s: float) -> dict:
    doc = result.as_dict()
    return {k: doc[k] for k in ("scenario", "method", "hours", "replan_interval_min", "cost_usd", "cost_usd_per_day",
                                "usd_per_million_slo_tokens", "served_share", "max_replan_s", "nodes_launched",
                                "nodes_failed", "nodes_preempted")} | {
        "worst_window": doc["worst_window"]["window"], "worst_attainment": doc["worst_window"]["worst_attainment"],
        "windows_below_0_95": sum(w.worst_attainment < 0.95 for w in result.windows),
        "replans_over_half_interval": sum(w.replan_s > replan_limit_s for w in result.windows),
        "mixed_share_mean": sum(w.mixed_share for w in result.windows) / max(1, len(result.windows))}


def peak_over_mean(scn: Scenario, hours: float) -> float:
    """The day's total peak request rate over its mean across the windows: what a plan sized for the peak carries
    over what the day's demand needs on average."""
    n = window_count(scn, hours)
    mean = sum(sum(window_rates(scn, w).values()) for w in range(n)) / n
    return sum(peak_rates(scn, n).values()) / mean


def headline(rows: list[dict], bursts: bool = True) -> list[dict]:
    """Per scenario: the best baseline's $ per million SLO-met tokens over Coral's (the figure says when the day
    was run without the traces' bursts, or served request by request)."""
    out = []
    for name in sorted({r["scenario"] for r in rows}):
        mine = [r for r in rows if r["scenario"] == name]
        coral = next((r for r in mine if r["method"] == "coral"), None)
        others = [r for r in mine if r["method"] != "coral" and math.isfinite(r["usd_per_million_slo_tokens"])]
        if coral is None or not others:
            continue
        best = min(others, key=lambda r: r["usd_per_million_slo_tokens"])
        windows = round(coral["hours"] * 60 / coral["replan_interval_min"])
        ratio = best["usd_per_million_slo_tokens"] / coral["usd_per_million_slo_tokens"]
        how = "".join((", no bursts" if not bursts else "",
                       f", peak-to-trough {coral['peak_to_trough']:g}" if coral.get("peak_to_trough") != 2.0 else "",
                       ", steady supply" if coral.get("steady_supply") else "",
                       ", spot" if coral.get("spot") else "",
                       ", served request by request" if coral.get("serve_mode") == "requests" else ""))
        out.append({"figure": f"{name}, {coral['hours']:g} h day{how}: best baseline ({best['method']}) ÷ Coral, "
                              "$ per million SLO-met tokens",
                    "paper": f"goal ≥ {GOAL_X}× on the large-model scenario" if name == "large" else None,
                    "ours": f"{ratio:.3f}× (bound vs static-peak: peak ÷ mean demand "
                            f"{coral['demand_peak_over_mean']:.2f}×; windows below 0.95: Coral "
                            f"{coral['windows_below_0_95']}, {best['method']} {best['windows_below_0_95']} of "
                            f"{windows})", "rule": "slo",
                    "availability": ("market profile all day, no series (steady supply)" if coral.get("steady_supply")
                                     else "market profile and its series over the day (data/scenarios/MARKET.md §5)"),
                    "section": "a day (data/scenarios/DAY.md)"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="core,extended,large")
    ap.add_argument("--methods", default=",".join(DAY_METHODS))
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--scale", default="extended=0.2", help="NAME=FACTOR,...: request rates × FACTOR")
    ap.add_argument("--no-bursts", action="store_true",
                    help="windows follow the diurnal shape only, not their traces' bursts (DAY.md §2)")
    ap.add_argument("--steady-supply", action="store_true",
                    help="availability stays at the market profile all day (no series: MARKET.md §5's cycle off)")
    ap.add_argument("--spot", action="store_true",
                    help="nodes sold on spot run there at spot prices and are preempted (DAY.md §4)")
    ap.add_argument("--peak-to-trough", type=float, default=None,
                    help="the diurnal peak-to-trough ratio instead of each scenario's (DAY.md §2's assumption)")
    ap.add_argument("--sizing", choices=("forecast", "window"), default="forecast",
                    help="what each re-plan sizes for: the forecast over the start-up lead, or the window's rates")
    ap.add_argument("--serve", choices=("fluid", "requests"), default="fluid",
                    help="serve each window as a fluid estimate or request by request in the simulator")
    ap.add_argument("--db", default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    stop_on_sigterm()  # a killed run removes its scratch deployment store, as Ctrl-C does
    scales = _scales(args.scale)
    rows: list[dict] = []
    results: dict[str, list] = {}
    for name in filter(None, args.scenarios.split(",")):
        scn = scaled(load_scenario(name), scales.get(name, 1.0))
        if args.no_bursts:
            scn = replace(scn, day=replace(day_spec(scn), bursts=False))
        if args.steady_supply:
            scn = replace(scn, availability_model=replace(scn.availability_model, series=None))
        if args.peak_to_trough is not None:
            scn = replace(scn, day=replace(day_spec(scn), peak_to_trough=args.peak_to_trough, hourly=()))
        if args.spot:
            scn = replace(scn, day=replace(day_spec(scn), spot=True))
        bound = peak_over_mean(scn, args.hours)
        templates = library_templates(scn, args.db)
        limit = scn.replan_interval_min * 30.0
        for method in filter(None, args.methods.split(",")):
            started = time.perf_counter()
            with Progress(console=console, transient=True) as bar:
                task = bar.add_task(f"{name} {method}", total=window_count(scn, args.hours))
                res = run_day(scn, method, hours=args.hours, db_path=args.db, templates=templates, serve=args.serve,
                              sizing=args.sizing, progress=lambda row: bar.advance(task))
            wall_s = time.perf_counter() - started
            rows.append(summary(res, limit) | {"rate_scale": scales.get(name, 1.0), "serve_mode": args.serve,
                                               "sizing": args.sizing, "peak_to_trough": day_spec(scn).peak_to_trough,
                                               "steady_supply": args.steady_supply, "spot": args.spot,
                                               "demand_peak_over_mean": bound,
                                               "wall_s": wall_s, "wall_s_per_window": wall_s / len(res.windows)})
            results.setdefault(name, []).append(res)
            console.print(rows[-1])
        write_timeline(results[name], args.out.with_name(f"{args.out.stem}_{name}.png") if args.out
                       else RESULTS / f"day_{name}.png")
    table = Table(title="a day per scenario and method")
    cols = ["scenario", "method", "cost_usd", "usd_per_million_slo_tokens", "served_share", "worst_attainment",
            "windows_below_0_95", "max_replan_s", "replans_over_half_interval", "nodes_failed", "nodes_preempted",
            "mixed_share_mean"]
    for c in cols:
        table.add_column(c)
    for r in rows:
        table.add_row(*(f"{r[c]:,.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    console.print(table)
    path = write_result("day", {"hours": args.hours, "scales": scales, "bursts": not args.no_bursts,
                                "serve_mode": args.serve, "sizing": args.sizing, "peak_to_trough": args.peak_to_trough,
                                "spot": args.spot,
                                "headline": headline(rows, not args.no_bursts), "rows": rows}, out=args.out)
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
