"""Template throughput the simulator can reach: a sample of each library's templates, one instance alone at 95% of
its T̂ with Poisson arrivals, and the share of its requests that meet the SLO.

The sample is stratified: per scenario, `--per-stratum` templates (seeded draw) of every (phase, single or
multi-stage, one GPU type or mixed) the library holds. The target (issue 12.4): ≥ 95% of requests within the SLO
for ≥ 95% of the sample. Libraries are read from the DuckDB store (`coral templates build --scenario S` first).
Prints a table and writes bench/results/template_reach.json.

    python bench/template_reach.py [--scenarios core,extended,helix] [--per-stratum 2] [--load 0.95] [--seed 0]
        [--phases prefill,decode,aggregated] [--out bench/results/template_reach.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.errors import CoralError
from coral_dagster.simulator.latency import ProfileLatencyModel
from coral_dagster.simulator.reach import template_reach
from coral_dagster.store import Store
from coral_dagster.templates.library import load_library
from coral_dagster.vocab import PHASES

RESULTS = Path(__file__).resolve().parent / "results" / "template_reach.json"
TARGET_ATTAINMENT, TARGET_SHARE = 0.95, 0.95


def stratum(t) -> tuple[str, str, str]:
    mixed = len({n.gpu for n in t.nodes.as_dict()}) > 1
    return t.phase, "multi-stage" if len(t.stages) > 1 else "one stage", "mixed" if mixed else "one GPU type"


def sample(templates, per_stratum: int, seed: int, phases=PHASES) -> list:
    """Up to `per_stratum` templates of every stratum of `phases`, drawn with `seed` from the library in
    template-id order."""
    groups = defaultdict(list)
    for t in sorted(templates, key=lambda t: t.template_id):
        if t.tokens_per_s > 0 and t.phase in phases:
            groups[stratum(t)].append(t)
    rng = random.Random(seed)
    return [t for key in sorted(groups) for t in rng.sample(groups[key], min(per_stratum, len(groups[key])))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="core,extended,helix", help="comma-separated scenarios whose stored libraries are sampled")
    ap.add_argument("--per-stratum", type=int, default=2, help="templates drawn per stratum (phase, one or several stages, one or several GPU types)")
    ap.add_argument("--load", type=float, default=0.95, help="offered load as a share of each template's T̂")
    ap.add_argument("--seed", type=int, default=0, help="seed of the draw and of the Poisson arrivals")
    ap.add_argument("--min-requests", type=int, default=1500, help="requests each simulation serves at least")
    ap.add_argument("--phases", default="prefill,decode,aggregated", help="comma-separated phases to sample")
    ap.add_argument("--out", type=Path, default=RESULTS, help="JSON file to write")
    args = ap.parse_args()
    phases = tuple(p for p in args.phases.split(",") if p)
    store = Store()
    latency = ProfileLatencyModel()
    rows = []
    for name in args.scenarios.split(","):
        scn = load_scenario(name)
        library = load_library(store, scn) if store.path.exists() else []
        if not library:
            raise CoralError(f"no template library for {name} in {store.path}.",
                             f"build it first: coral templates build --scenario {name}")
        for t in sample(library, args.per_stratum, args.seed, phases):
            start = time.perf_counter()
            r = template_reach(t, scn, load=args.load, seed=args.seed, min_requests=args.min_requests,
                               latency=latency)
            rows.append({"scenario": name, **dataclasses.asdict(r), "stratum": " / ".join(stratum(t)),
                         "meets": r.attainment >= TARGET_ATTAINMENT, "wall_s": time.perf_counter() - start})
    share = sum(r["meets"] for r in rows) / len(rows) if rows else 0.0
    table = Table(title=f"One template alone at {args.load:.0%} of T̂, Poisson: {share:.1%} of {len(rows)} "
                        f"templates reach ≥ {TARGET_ATTAINMENT:.0%} SLO attainment (target: ≥ {TARGET_SHARE:.0%})")
    for col in ("scenario", "model", "phase", "stages", "nodes", "T̂ tok/s", "req/s", "requests", "attainment",
                "TTFT p99 ms", "TPOT p99 ms"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["scenario"], r["model"], r["phase"], str(r["stages"]), r["nodes"], f"{r['tokens_per_s']:,.0f}",
                      f"{r['rate_req_s']:.2f}", str(r["requests"]),
                      f"[{'green' if r['meets'] else 'red'}]{r['attainment']:.1%}", f"{r['ttft_p99_ms']:,.0f}",
                      f"{r['tpot_p99_ms']:,.1f}")
    Console(width=180).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"load": args.load, "seed": args.seed, "per_stratum": args.per_stratum,
                                    "phases": list(phases),
                                   "share_meeting_target": share, "target_attainment": TARGET_ATTAINMENT,
                                    "target_share": TARGET_SHARE, "templates": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
