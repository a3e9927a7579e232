"""Template library benchmark: core and extended build times, library sizes, fast method vs the paper's ILP, and
the paper's motivating case (Qwen3-235B prefill, best mixed vs best pure-H100 template in tokens/s per $).

Run: `python bench/templates.py [--skip-extended] [--ilp-cases-per-key N] [--ilp-time-limit-s S]`.
Writes bench/results/templates.json and prints rich tables.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from coral_dagster.catalog.models import get_model
from coral_dagster.catalog.nodes import NodeMultiset
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.store import Store
from coral_dagster.templates.best import optimize
from coral_dagster.templates.library import build_library_with_stats, check_library, enumerate_multisets, store_library
from coral_dagster.templates.optimize import best_placement_ilp
from coral_dagster.templates.throughput import build_tables, workload_for
from coral_dagster.vocab import DEMAND_PHASES, PHASES

RESULTS = Path(__file__).resolve().parent / "results" / "templates.json"
console = Console(width=160)


def build(name: str, processes: int) -> tuple[list, dict]:
    """Build one scenario's library, re-verify every template, and time storing it in a scratch DuckDB file."""
    load_before = os.getloadavg()
    templates, stats = build_library_with_stats(name, processes=processes, progress=True)
    load_after = os.getloadavg()
    scn = load_scenario(name)
    start = time.perf_counter()
    tables = {(m.model, p): build_tables(workload_for(m, p, scn.link_gbps), scn.node_configs, scn.n_max)
              for m in scn.models for p in PHASES}
    problems = check_library(templates, tables)
    verify_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        stored = store_library(Store(Path(tmp) / "bench.duckdb"), templates, name)
        store_s = time.perf_counter() - start
    per_key = stats.as_frame()
    return templates, {
        "scenario": name, "processes": stats.processes, "build_s": stats.total_s, "tables_s": stats.tables_s,
        "optimize_s": stats.optimize_s, "templates": len(templates), "stored": stored, "store_s": store_s,
        "multisets_optimized": int(per_key.multisets.sum()), "verify_s": verify_s,
        "verify_problems": len(problems), "first_problems": problems[:5],
        "loadavg_1min_before": load_before[0], "loadavg_1min_after": load_after[0],
        "per_model_phase": per_key.to_dict(orient="records"),
    }


def ilp_cases(per_key: int, time_limit_s: float, seed: int = 0) -> dict:
    """The fast method and the paper's ILP on the same multisets (random ones of 2-4 nodes per model and phase)."""
    rng = random.Random(seed)
    picks = [("core", m.model, p, size) for m in load_scenario("core").models
             for p in PHASES for size in (2, 3, 4)]
    picks += [("extended", a, p, size) for a in ("llama-3.1-70b", "qwen3-235b-a22b")
              for p in DEMAND_PHASES for size in (2, 3)]
    rows = []
    for scenario, model, phase, size in picks:
        scn = load_scenario(scenario)
        tables = build_tables(workload_for(scn.model(model), phase, scn.link_gbps), scn.node_configs, scn.n_max)
        pool = [c for c in enumerate_multisets(scn.node_configs, get_model(model).total_weight_bytes, scn.n_max,
                                               scn.rho) if sum(c) == size]
        for counts in rng.sample(pool, min(per_key, len(pool))):
            nodes = NodeMultiset.of({n: k for n, k in zip(scn.node_configs, counts) if k})
            reps, start = 20, time.perf_counter()
            for _ in range(reps):
                fast = optimize(tables, nodes, "fast")
            fast_s = (time.perf_counter() - start) / reps
            configs = tuple(n for n, _ in nodes.counts)
            sub = {s: t for s, t in tables.rows(configs).items() if s <= nodes.size}
            ilp = best_placement_ilp(tuple(k for _, k in nodes.counts), sub, tables.n_layers, time_limit_s)
            fv = fast.tokens_per_s if fast else 0.0
            iv = ilp.placement.tokens_per_s if ilp.placement else 0.0
            rows.append({"scenario": scenario, "model": model, "phase": phase, "nodes": str(nodes),
                         "fast_tokens_per_s": fv, "ilp_tokens_per_s": iv, "fast_s": fast_s, "ilp_s": ilp.solve_s,
                         "ilp_proven_optimal": ilp.all_optimal, "ilp_variables": ilp.n_variables,
                         "identical": abs(fv - iv) <= 1e-6 * max(fv, iv, 1e-12)})
            console.print(f"  {model} {phase} {nodes}: fast {fast_s * 1e3:.2f} ms, ILP {ilp.solve_s:.2f} s, "
                          f"{'same optimum' if rows[-1]['identical'] else 'DIFFERENT'}")
    ratios = [r["ilp_s"] / r["fast_s"] for r in rows]
    return {
        "cases": rows, "n": len(rows), "identical": sum(r["identical"] for r in rows),
        "ilp_proven_optimal": sum(r["ilp_proven_optimal"] for r in rows),
        "fast_total_s": sum(r["fast_s"] for r in rows), "ilp_total_s": sum(r["ilp_s"] for r in rows),
        "speed_ratio_total": sum(r["ilp_s"] for r in rows) / sum(r["fast_s"] for r in rows),
        "speed_ratio_median": statistics.median(ratios), "speed_ratio_min": min(ratios),
        "ilp_time_limit_s": time_limit_s,
    }


def motivating_case(templates: list) -> dict:
    """Qwen3-235B prefill at 1800 ms: best mixed-GPU vs best pure-H100 template (≤ 6 nodes) by tokens/s per $,
    per region of the extended scenario on the bundled prices (a template runs in one region)."""
    market = load_scenario("extended").market()
    mine = [t for t in templates if t.model == "qwen3-235b-a22b" and t.phase == "prefill" and t.slo_ms == 1800]
    out = {"model": "qwen3-235b-a22b", "phase": "prefill", "slo_ms": 1800, "templates": len(mine), "regions": {}}
    for region in market.regions:
        best: dict[str, dict] = {}
        for t in mine:
            if any(market.offer(region, n) is None for n, _ in t.nodes.counts):
                continue
            usd = sum(market.price(region, n) * k for n, k in t.nodes.counts)
            gpus = {n.gpu for n, _ in t.nodes.counts}
            kind = "pure_h100" if gpus == {"H100"} else "mixed" if len(gpus) > 1 else None
            for k in ("any", kind):
                if k and (k not in best or t.tokens_per_s / usd > best[k]["tokens_per_s_per_usd_hour"]):
                    best[k] = {"nodes": str(t.nodes), "tokens_per_s": t.tokens_per_s, "usd_per_hour": usd,
                               "tokens_per_s_per_usd_hour": t.tokens_per_s / usd, "pp_partition": t.pp_partition,
                               "bound": t.bound}
        if "mixed" in best and "pure_h100" in best:
            best["mixed_over_pure_h100"] = (best["mixed"]["tokens_per_s_per_usd_hour"]
                                            / best["pure_h100"]["tokens_per_s_per_usd_hour"])
        out["regions"][region] = best
    return out


def show(doc: dict) -> None:
    t = Table(title="Template library builds")
    for col in ("scenario", "processes", "multisets", "templates", "build s", "tables s", "verify problems",
                "store s", "load avg"):
        t.add_column(col, justify="right")
    for key in ("core", "extended"):
        b = doc.get(key)
        if b:
            t.add_row(b["scenario"], str(b["processes"]), f"{b['multisets_optimized']:,}", f"{b['templates']:,}",
                      f"{b['build_s']:.1f}", f"{b['tables_s']:.1f}", str(b["verify_problems"]), f"{b['store_s']:.1f}",
                      f"{b['loadavg_1min_before']:.1f}→{b['loadavg_1min_after']:.1f}")
    console.print(t)
    for key in ("core", "extended"):
        b = doc.get(key)
        if b:
            t = Table(title=f"Templates per (model, phase) — {key}")
            for col in ("model", "phase", "slo ms", "multisets", "feasible", "kept"):
                t.add_column(col, justify="right")
            for r in b["per_model_phase"]:
                t.add_row(r["model"], r["phase"], f"{r['slo_ms']:g}", f"{r['multisets']:,}", f"{r['feasible']:,}",
                          f"{r['kept']:,}")
            console.print(t)
    f = doc["fast_vs_ilp"]
    console.print(f"fast vs ILP: {f['identical']}/{f['n']} identical optima ({f['ilp_proven_optimal']} ILPs proven "
                  f"optimal); speed ratio total {f['speed_ratio_total']:,.0f}×, median {f['speed_ratio_median']:,.0f}×, "
                  f"min {f['speed_ratio_min']:,.0f}×")
    m = doc.get("motivating_case")
    if m:
        t = Table(title="Qwen3-235B prefill @1800 ms: best template by tokens/s per $/h")
        for col in ("region", "kind", "nodes", "tokens/s", "$/h", "tokens/s per $/h"):
            t.add_column(col, justify="right")
        for region, best in m["regions"].items():
            for kind in ("mixed", "pure_h100", "any"):
                if kind in best:
                    b = best[kind]
                    t.add_row(region, kind, b["nodes"], f"{b['tokens_per_s']:,.0f}", f"{b['usd_per_hour']:.2f}",
                              f"{b['tokens_per_s_per_usd_hour']:,.0f}")
        console.print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-extended", action="store_true", help="Build only the core library.")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--ilp-cases-per-key", type=int, default=1)
    ap.add_argument("--ilp-time-limit-s", type=float, default=300.0)
    args = ap.parse_args()
    doc: dict = {"cpus": os.cpu_count(),
                 "note": "2-core machine shared with other processes; load averages show the contention."}
    _, doc["core"] = build("core", args.processes)
    if not args.skip_extended:
        extended, doc["extended"] = build("extended", args.processes)
        doc["motivating_case"] = motivating_case(extended)
    console.print("fast method vs the paper's ILP:")
    doc["fast_vs_ilp"] = ilp_cases(args.ilp_cases_per_key, args.ilp_time_limit_s)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=2, default=str))
    show(doc)
    console.print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
