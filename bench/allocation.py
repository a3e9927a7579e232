"""Allocation benchmark: Coral, Homo-ILP, Homo and Cauchy on the same inputs, and Helix on its cluster.

Writes bench/results/allocation.json and prints the tables (see coral_dagster/allocation/experiments.py for the
settings). Usage: python bench/allocation.py [--scenarios core,extended] [--settings ...] [--no-helix]
[--sim-duration-s 60]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from coral_dagster.allocation.experiments import BenchConfig, run_allocation_bench
from coral_dagster.allocation.scenario_plans import library_templates
from coral_dagster.cli.plan import print_bench
from coral_dagster.plots import bench_png

OUT = Path(__file__).resolve().parent / "results" / "allocation.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="core,extended")
    ap.add_argument("--settings", default="default,imbalanced,scarcity,replan")
    ap.add_argument("--no-helix", action="store_true")
    ap.add_argument("--helix-slo-ms", default="20000,1000",
                    help="prefill,decode SLO (ms) of the Helix comparison; `scenario` keeps the scenario's")
    ap.add_argument("--sim-duration-s", type=float, default=BenchConfig.sim_duration_s,
                    help="seconds of arrivals each plan is simulated for (simulated goodput); 0 disables it")
    ap.add_argument("--sim-trace", default=BenchConfig.sim_trace,
                    help="arrivals of the simulation: poisson (default), gamma, scenario (replay each model's "
                         "trace), azure-conv or azure-code")
    ap.add_argument("--no-sim-replan", action="store_true", help="do not simulate the re-plan windows")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    slo = None if args.helix_slo_ms == "scenario" else tuple(float(x) for x in args.helix_slo_ms.split(","))
    config = BenchConfig(scenarios=tuple(args.scenarios.split(",")), settings=tuple(args.settings.split(",")),
                         helix=not args.no_helix, helix_slo_ms=slo, sim_duration_s=args.sim_duration_s,
                         sim_trace=args.sim_trace, sim_replan=not args.no_sim_replan)
    doc = run_allocation_bench(library_templates, config, progress=lambda it, desc: tqdm(list(it), desc=desc))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2, default=str))
    args.out.with_suffix(".png").write_bytes(bench_png(doc))
    print_bench(doc)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
