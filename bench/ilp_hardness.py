"""Why a scenario's default allocation ILP is not proven in time: its LP, the nodes that bind, HiGHS per seed.

Builds `ilp.min_cost`'s ILP with nothing running (C1 availability, C2 demand per region with capped coefficients,
C2' routing) over the pruned columns directly in highspy: a second formulation, whose LP must equal the project's
(`ilp.min_cost(..., integer=False)` through PuLP; the bench stops if they differ). Reports the LP optimum and the
shadow price of every binding availability row beside the node's price; per HiGHS random seed, the plan and the
bound reached in `--time-limit-s`, over every column and without the columns a pair of others of the same model,
phase and region dominates (two instances using no more nodes of any configuration give no less: exact, as a plan
using the column can use the pair instead at no more cost); and the time to prove the ILP with every model's
routing fixed at the LP's split, which leaves the regions independent. Prints a table, writes
bench/results/ilp_hardness.json.

    CORAL_DB=<a DuckDB holding the library> python bench/ilp_hardness.py [--scenario core] [--seeds 0,1,2,3,4,5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "results" / "ilp_hardness.json"


def _model(problem, columns):
    """The ILP in highspy: (its Highs object, the column of each (model, region) routing share, the row of each
    availability constraint)."""
    import highspy

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    n, inf = len(columns), highspy.kHighsInf
    h.addVars(n, np.zeros(n), np.array([c.max_count for c in columns], dtype=float))
    h.changeColsCost(n, np.arange(n, dtype=np.int32), np.array([c.usd_per_hour for c in columns]))
    h.changeColsIntegrality(n, np.arange(n, dtype=np.int32), np.array([highspy.HighsVarType.kInteger] * n))
    keys = [k for k, d in sorted(problem.demand_tokens_per_s.items()) if d > 0]
    share = {}
    for model in sorted({k[0] for k in keys}):
        for region in problem.regions:
            share[(model, region)] = h.getNumCol()
            h.addVar(0.0, 1.0)
    avail_rows = {}
    by_row: dict[tuple, list[tuple[int, float]]] = {}
    for j, col in enumerate(columns):
        for node, count in col.template.nodes.counts:
            by_row.setdefault((col.region, node), []).append((j, float(count)))
    for row, terms in sorted(by_row.items(), key=str):
        avail_rows[row] = h.getNumRow()
        h.addRow(-inf, problem.available_nodes.get(row, 0), len(terms), np.array([j for j, _ in terms], np.int32),
                 np.array([v for _, v in terms]))
    for model, phase in keys:
        for region in problem.regions:
            demand = problem.demand_tokens_per_s[(model, phase)]
            terms = [(j, min(1.0, problem.contribution(c.template, phase) / demand)) for j, c in enumerate(columns)
                     if c.region == region and (model, phase) in problem.serves(c.template)]
            terms.append((share[(model, region)], -1.0))
            h.addRow(0.0, inf, len(terms), np.array([j for j, _ in terms], np.int32), np.array([v for _, v in terms]))
    for model in sorted({k[0] for k in keys}):
        idx = np.array([share[(model, r)] for r in problem.regions], np.int32)
        h.addRow(1.0, 1.0, len(idx), idx, np.ones(len(idx)))
    return h, share, avail_rows


def _pair_dominated(columns) -> np.ndarray:
    """Per column, whether two instances of columns of its model, phase and region use no more nodes of any
    configuration and give no fewer tokens/s."""
    configs = sorted({n for c in columns for n, _ in c.template.nodes.counts}, key=str)
    use = np.array([[dict(c.template.nodes.counts).get(n, 0) for n in configs] for c in columns])
    out = np.zeros(len(columns), dtype=bool)
    groups: dict[tuple, list[int]] = {}
    for j, c in enumerate(columns):
        groups.setdefault((c.template.model, c.template.phase, c.region), []).append(j)
    for js in groups.values():
        best: dict[tuple, float] = {}
        for j in js:
            best[tuple(use[j])] = max(best.get(tuple(use[j]), 0.0), columns[j].template.tokens_per_s)
        pairs: dict[tuple, float] = {}
        for (u1, t1), (u2, t2) in itertools.combinations_with_replacement(best.items(), 2):
            u = tuple(a + b for a, b in zip(u1, u2))
            pairs[u] = max(pairs.get(u, 0.0), t1 + t2)
        pu, pt = np.array(list(pairs)), np.array(list(pairs.values()))
        for j in js:
            out[j] = bool(np.any(np.all(pu <= use[j], axis=1) & (pt >= columns[j].template.tokens_per_s)))
    return out


def _solve(model, time_limit_s: float, seed: int = 0, *, integer: bool = True, fixed=None) -> dict:
    """Solve a fresh copy of `model` (a HighsModel) with a seed and limit, some bounds `fixed`; LP when not
    `integer`."""
    import highspy

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.passModel(model)
    n = h.getNumCol()
    for j, (lo, hi) in (fixed or {}).items():
        h.changeColBounds(j, lo, hi)
    if not integer:
        h.changeColsIntegrality(n, np.arange(n, dtype=np.int32), np.array([highspy.HighsVarType.kContinuous] * n))
    h.setOptionValue("time_limit", time_limit_s)
    h.setOptionValue("random_seed", seed)
    h.setOptionValue("mip_rel_gap", 1e-4)
    start = time.perf_counter()
    h.run()
    wall = time.perf_counter() - start
    info = h.getInfo()
    return {"status": str(h.getModelStatus()).split(".")[-1], "wall_s": wall,
            "objective": info.objective_function_value if info.primal_solution_status == 2 else None,
            "bound": info.mip_dual_bound if integer else info.objective_function_value,
            "col_value": list(h.getSolution().col_value), "row_dual": list(h.getSolution().row_dual)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="core", help="bundled scenario name or file")
    ap.add_argument("--availability-scale", type=float, default=1.0, help="every availability times this")
    ap.add_argument("--seeds", default="0,1,2,3,4,5", help="HiGHS random seeds, comma-separated")
    ap.add_argument("--time-limit-s", type=float, default=10.0, help="limit per seeded solve")
    ap.add_argument("--fixed-limit-s", type=float, default=120.0, help="limit of the solve with routing fixed")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    from coral_dagster.allocation import ilp
    from coral_dagster.allocation.inputs import scenario_problem
    from coral_dagster.allocation.prune import prune_columns
    from coral_dagster.app.scenario_plans import library_templates
    from coral_dagster.catalog.scenarios import load_scenario

    scn = load_scenario(args.scenario)
    problem = scenario_problem(scn, library_templates(scn), scn.market(availability_scale=args.availability_scale))
    columns, _ = prune_columns(problem)
    h, share, avail_rows = _model(problem, columns)
    model = h.getModel()
    lp = _solve(model, 600.0, integer=False)
    reference = ilp.min_cost(problem, columns, integer=False, time_limit_s=600.0).objective
    if abs(lp["objective"] - reference) > 1e-6 * max(1.0, abs(reference)):
        raise SystemExit(f"the highspy LP ({lp['objective']:.6f}) differs from ilp.min_cost's ({reference:.6f})")
    binding = [{"region": r, "node": str(node), "usd_per_node_hour": problem.usd_per_hour[(r, node)],
                "shadow_usd_per_node_hour": -lp["row_dual"][i]}
               for (r, node), i in avail_rows.items() if -lp["row_dual"][i] > 1e-6]
    dominated = _pair_dominated(columns)
    off = {int(j): (0.0, 0.0) for j in np.nonzero(dominated)[0]}
    runs = []
    for seed in [int(s) for s in args.seeds.split(",") if s]:
        for variant, fixed in (("all columns", None), ("pair-dominated removed", off)):
            r = _solve(model, args.time_limit_s, seed, fixed=fixed)
            runs.append({"seed": seed, "variant": variant,
                         **{k: r[k] for k in ("status", "wall_s", "objective", "bound")}})
            print(json.dumps(runs[-1]), flush=True)
    route = {j: (lp["col_value"][j], lp["col_value"][j]) for j in share.values()}
    routed = _solve(model, args.fixed_limit_s, fixed=route)
    doc = {"scenario": scn.name, "availability_scale": args.availability_scale, "columns": len(columns),
           "pair_dominated": int(dominated.sum()), "lp_usd_per_hour": lp["objective"], "binding": binding,
           "time_limit_s": args.time_limit_s, "runs": runs,
           "routing_fixed_at_lp": {k: routed[k] for k in ("status", "wall_s", "objective", "bound")}}
    print(f"{scn.name} ×{args.availability_scale:g}: {len(columns)} columns ({doc['pair_dominated']} "
          f"pair-dominated), LP {lp['objective']:.2f} $/h")
    print("| region | node | $/node-h | shadow $/node-h |\n|---|---|---:|---:|")
    for b in binding:
        print(f"| {b['region']} | {b['node']} | {b['usd_per_node_hour']:.3f} | {b['shadow_usd_per_node_hour']:.3f} |")
    print(f"| seed | columns | status | $/h at {args.time_limit_s:g} s | bound | gap |\n|---|---|---|---:|---:|---:|")
    for r in runs:
        obj = r["objective"]
        gap = f"{(obj - r['bound']) / obj:.1%}" if obj else "–"
        print(f"| {r['seed']} | {r['variant']} | {r['status']} | {obj or float('nan'):.2f} | {r['bound']:.2f} | "
              f"{gap} |")
    f = doc["routing_fixed_at_lp"]
    print(f"routing fixed at the LP's split: {f['status']} in {f['wall_s']:.1f} s, "
          f"{f['objective'] or float('nan'):.2f} $/h (bound {f['bound']:.2f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
