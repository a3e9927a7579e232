"""The map of the gain: where mixing GPU types pays, over availability shapes, price vectors and T̂ rules.

Each cell is one (scenario, T̂ rule, price vector, GPU-tier power, node-size power). Availability is the scenario's
market profile (data/scenarios/MARKET.md) with its GPU and size factors raised to the powers (0: no scarcity of
that kind, every type or size as plentiful as the mid-tier 1-GPU node; 1: MARKET.md's shape, the new default;
2: severe), times `--levels`, at window 0 of its series. Prices: `list` (the bundled SkyPilot table, regions sell
part of the menu) or `paper` (data/prices/paper_normalised.csv: the paper's per-GPU prices, every configuration
sold). Every method plans the same demand with the same library: under the `slo` rule the burst-aware capacity
rule (what `bench.equal_attainment` starts its closed loop from; each plan's worst-model attainment on held-out
windows is shown beside, so "equal attainment" can be checked cell by cell), under the `paper` rule fixed demand
(the paper's tables). A method that cannot meet the demand is shown with the share it serves when scaled down
(`--scarcity scale`). Per cell: Coral ÷ Homo-ILP, ÷ Cauchy, ÷ Homo (their cost over Coral's), the share of
Coral's instances whose template mixes GPU types (where Coral cannot meet demand, of the plan serving its share),
and what binds (nodes at their count in Coral's and Homo-ILP's
plans, or the binding nodes an infeasible method reports). Writes bench/results/heterogeneity.json (headline rows)
and heterogeneity.png (one heat map per scenario × rule × prices × level). `--mixes` repeats the map under
imbalanced demand (coral.md §6), rows labelled `scenario:mix`; `--levels` below 1 is the paper's scarcity
experiment, every method's served share beside (`scale` mode).

    python -m bench.heterogeneity [--scenarios core,extended] [--rules slo,paper] [--prices list,paper]
        [--gpu-powers 0,1,2] [--size-powers 0,1] [--levels 1] [--mixes uniform] [--time-limit-s 15] [--seeds '']
        [--duration-s 300]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from bench._args import names
from bench._results import RESULTS, write_result
from coral_dagster.allocation.demand import DEMAND_MIXES
from coral_dagster.allocation.goodput import fluid_goodput
from coral_dagster.allocation.inputs import mixed_scenario
from coral_dagster.app.scenario_plans import library_templates, plan_scenario
from coral_dagster.app.equal_attainment import evaluate
from coral_dagster.catalog.nodes import NodeConfig
from coral_dagster.catalog.prices import PAPER_PRICES, read_price_file
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.errors import CoralError, UnknownNameError

METHODS = ("coral", "homo-ilp", "cauchy", "homo")
BASELINES = ("homo-ilp", "cauchy", "homo")
PAYS = 1.05  # a cell where a baseline costs ≥ 5% more than Coral is one where mixing pays (solver gaps are ≤ ~5%)


def price_table(name: str):
    """The price vector by name: None for the bundled list prices, else the paper's normalised prices."""
    if name == "list":
        return None
    if name == "paper":
        return read_price_file(PAPER_PRICES)
    raise CoralError(f"unknown price vector {name!r}.", "use list or paper.")


def with_rule(scn, rule: str):
    """The scenario under a T̂ rule; its library is keyed by the rule, so each rule's library is built once."""
    if not hasattr(scn, "t_hat_rule"):
        raise CoralError(f"T̂ rule {rule!r} needs a build with selectable rules.", "use --rules slo.")
    return replace(scn, t_hat_rule=rule)


def mixed(instance) -> bool:
    return len({n.gpu for n, _ in instance.template.nodes.counts}) > 1


def at_cap(plan, market) -> list[str]:
    """(region, node) the plan uses every available node of."""
    return sorted(f"{node}@{region}" for (region, node), k in plan.nodes_used().items()
                  if k >= market.availability(region, NodeConfig.parse(node)) > 0)


def method_result(scn, method, templates, market, args, seeds, burst_aware: bool) -> dict:
    """One method in one cell: cost, status, mixed share and binding nodes, or what it serves when it cannot."""
    t0 = time.perf_counter()
    out = {"method": method}
    try:
        plan = plan_scenario(scn, method=method, templates=templates, market=market, burst_aware=burst_aware,
                             time_limit_s=args.time_limit_s)
    except CoralError as exc:
        out["error"] = str(exc)[:300]
        if "Binding nodes" in str(exc):
            out["binding"] = str(exc).split("Binding nodes")[1].split(". Fix")[0][:200]
        try:
            reach = plan_scenario(scn, method=method, templates=templates, market=market, burst_aware=burst_aware,
                                  scarcity="scale", time_limit_s=args.time_limit_s)
            out["served_share"] = min(fluid_goodput(reach).per_model.values())
            out["reach_usd_per_hour"] = reach.cost_usd_per_hour
            out["reach_mixed_share"] = (sum(i.count for i in reach.instances if mixed(i))
                                        / max(1, sum(i.count for i in reach.instances)))
        except CoralError as again:
            out["reach_error"] = str(again)[:160]
        out["wall_s"] = time.perf_counter() - t0
        return out
    total = sum(i.count for i in plan.instances)
    out.update(status=plan.status, usd_per_hour=plan.cost_usd_per_hour, mip_gap=plan.mip_gap, instances=total,
               mixed_share=sum(i.count for i in plan.instances if mixed(i)) / total if total else 0.0,
               mixed_bounds=sorted({i.template.bound for i in plan.instances if mixed(i)}),
               at_cap=at_cap(plan, market))
    if burst_aware and seeds and method in ("coral", "homo-ilp"):
        out["worst_attainment"] = evaluate(plan, scn, seeds, args.duration_s)["worst_attainment"]
    out["wall_s"] = time.perf_counter() - t0
    return out


def cell_row(scn_name, rule, prices, gp, sp, level, results: dict) -> dict:
    """The cell's row: each baseline's cost over Coral's, Coral's mixed share, what binds."""
    coral = results["coral"]
    row = {"scenario": scn_name, "rule": rule, "prices": prices, "gpu_power": gp, "size_power": sp, "level": level,
           "coral_usd_per_hour": coral.get("usd_per_hour"), "coral_status": coral.get("status"),
           "mixed_share": coral.get("mixed_share"), "coral_at_cap": coral.get("at_cap"),
           "coral_attainment": coral.get("worst_attainment"), "methods": results}
    if "served_share" in coral:
        row["coral_served_share"] = coral["served_share"]
        row["mixed_share"] = coral.get("reach_mixed_share")  # of the plan serving that share
    for b in BASELINES:
        r = results.get(b, {})
        if coral.get("usd_per_hour") and r.get("usd_per_hour"):
            row[f"{b}_x_coral"] = r["usd_per_hour"] / coral["usd_per_hour"]
        elif "served_share" in r:
            row[f"{b}_x_coral"] = None
            row[f"{b}_served_share"] = r["served_share"]
            if coral.get("served_share") is not None and r["served_share"] > 0:
                row[f"coral_over_{b}_served"] = coral["served_share"] / r["served_share"]
    homo_ilp = results.get("homo-ilp", {})
    row["binding"] = (f"Homo-ILP short: {homo_ilp['binding']}" if "binding" in homo_ilp else
                      f"at cap: Coral {', '.join(coral.get('at_cap') or []) or 'none'}; Homo-ILP "
                      f"{', '.join(homo_ilp.get('at_cap') or []) or 'none'}")
    return row


def describe(rows: list[dict]) -> list[str]:
    """In words: the cells where mixing inside a replica pays (Homo-ILP ≥ PAYS × Coral, or Homo-ILP cannot meet
    the demand Coral meets), by how much, and with what share of mixed instances."""
    lines = []
    for r in rows:
        ratio, share = r.get("homo-ilp_x_coral"), r.get("mixed_share") or 0.0
        where = (f"{r['scenario']} {r['rule']} rule, {r['prices']} prices, GPU-tier power {r['gpu_power']:g}, "
                 f"size power {r['size_power']:g}, level ×{r['level']:g}")
        if ratio is not None and ratio >= PAYS:
            lines.append(f"{where}: Homo-ILP costs {ratio:.2f}× Coral; {share:.0%} of Coral's instances mixed")
        elif r.get("homo-ilp_served_share") is not None and r.get("coral_usd_per_hour"):
            lines.append(f"{where}: Homo-ILP serves only {r['homo-ilp_served_share']:.1%} of demand, Coral all of "
                         f"it at {r['coral_usd_per_hour']:,.2f} $/h; {share:.0%} of Coral's instances mixed")
        elif (r.get("coral_over_homo-ilp_served") or 0) >= PAYS:
            lines.append(f"{where}: neither meets demand; Coral serves {r['coral_served_share']:.1%}, "
                         f"{r['coral_over_homo-ilp_served']:.2f}× Homo-ILP's {r['homo-ilp_served_share']:.1%}; "
                         f"{share:.0%} of Coral's instances mixed")
    return lines or ["no cell: Homo-ILP is within 5% of Coral wherever both meet demand"]


def heat_map(rows: list[dict], out: Path) -> None:
    """One panel per (scenario, rule, prices): GPU-tier power × size power, coloured by Homo-ILP ÷ Coral,
    annotated with the ratio (or Homo-ILP's served share) and Coral's mixed share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = sorted({(r["scenario"], r["rule"], r["prices"], r["level"]) for r in rows})
    cols = min(4, len(panels))
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.4 * rows_n), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (scn, rule, prices, level) in zip(axes.flat, panels):
        cells = [r for r in rows if (r["scenario"], r["rule"], r["prices"], r["level"]) == (scn, rule, prices, level)]
        gps, sps = sorted({r["gpu_power"] for r in cells}), sorted({r["size_power"] for r in cells})
        grid = np.full((len(sps), len(gps)), np.nan)
        for r in cells:
            i, j = sps.index(r["size_power"]), gps.index(r["gpu_power"])
            ratio, served = r.get("homo-ilp_x_coral"), r.get("homo-ilp_served_share")
            if ratio is not None:
                grid[i, j], text = ratio, f"{ratio:.2f}×"
            elif served is not None and r.get("coral_usd_per_hour"):
                grid[i, j], text = 2.0, f"H-ILP {served:.0%}"
            elif r.get("coral_over_homo-ilp_served") is not None:
                grid[i, j] = r["coral_over_homo-ilp_served"]
                text = f"serves\n{r['coral_served_share']:.0%} / {served:.0%}"
            else:
                text = "no Coral plan\nin time" if "error" in r["methods"]["coral"] else "–"
            light = not np.isnan(grid[i, j]) and grid[i, j] < 1.6  # viridis is dark below 1.6 on this scale
            ax.text(j, i, f"{text}\nmix {r.get('mixed_share') or 0:.0%}", ha="center", va="center", fontsize=8,
                    color="white" if light else "black")
        ax.imshow(grid, cmap="viridis", vmin=1.0, vmax=2.0, origin="lower")
        ax.set_xticks(range(len(gps)), [f"{g:g}" for g in gps])
        ax.set_yticks(range(len(sps)), [f"{s:g}" for s in sps])
        ax.set_xlabel("GPU-tier scarcity power")
        ax.set_ylabel("node-size scarcity power")
        ax.set_title(f"{scn} · {rule} rule · {prices} prices · ×{level:g}", fontsize=9)
    fig.suptitle("Homo-ILP cost ÷ Coral cost; where neither meets demand, Coral's served share ÷ Homo-ILP's "
                 "(Coral / Homo-ILP shown); 2 = only Coral meets it. Colour 1–2.", fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 0.94))
    fig.savefig(out, dpi=110)
    plt.close(fig)


#: The paper's figures for each (scenario, baseline) ÷ Coral (../shared/design/coral.md, "Headline results").
PAPER = {("core", "homo"): "1.62×", ("core", "cauchy"): "1.60×",
         ("extended", "homo"): "3.14× (cost); up to 7.64× goodput under scarcity",
         ("extended", "cauchy"): "2.66× (cost); up to 2.39× goodput under scarcity"}


def headline(rows: list[dict], default_cell) -> list[dict]:
    """Headline rows at the default cell of each scenario and rule (MARKET.md's shape, list prices); where no method
    meets demand, the shares of it each plan serves (the goodput it plans for)."""
    out = []
    for r in rows:
        if (r["gpu_power"], r["size_power"], r["prices"], r["level"]) != default_cell:
            continue
        for b in BASELINES:
            ours = (f"{r[f'{b}_x_coral']:.2f}×" if r.get(f"{b}_x_coral") is not None else
                    f"no method meets demand: Coral serves {r['coral_served_share']:.1%}, {b} "
                    f"{r[f'{b}_served_share']:.1%} ({r[f'coral_over_{b}_served']:.2f}× the goodput)"
                    if r.get(f"coral_over_{b}_served") is not None else
                    f"{b} serves {r[f'{b}_served_share']:.1%}" if r.get(f"{b}_served_share") is not None else "–")
            basis = "capacity rule, held-out attainment beside" if r["rule"] == "slo" else "fixed demand"
            out.append({"figure": f"{r['scenario']}: {b} ÷ Coral ({basis})",
                        "paper": PAPER.get((r["scenario"].split(":")[0], b)), "ours": ours, "rule": r["rule"],
                        "availability": "market profile (MARKET.md), window 0", "section": "heterogeneity"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default="core,extended")
    ap.add_argument("--rules", default="slo,paper", help="T̂ rules: slo (ours), paper")
    ap.add_argument("--prices", default="list,paper", help="price vectors: list, paper")
    ap.add_argument("--gpu-powers", default="0,1,2")
    ap.add_argument("--size-powers", default="0,1")
    ap.add_argument("--levels", default="1", help="availability multiples applied after the shape")
    ap.add_argument("--mixes", default="uniform", help=f"demand mixes of {', '.join(DEMAND_MIXES)}")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--time-limit-s", type=float, default=15.0, help="solver limit per plan")
    ap.add_argument("--seeds", default="", help="held-out seeds for the slo rule's attainment of Coral's and "
                    "Homo-ILP's plans, e.g. 11 (default none: the map then fits 30 min on 2 cores)")
    ap.add_argument("--duration-s", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--replot", type=Path, default=None, help="only redraw the heat map of this result JSON")
    args = ap.parse_args()
    if args.replot:
        heat_map(json.loads(args.replot.read_text())["rows"], args.replot.with_suffix(".png"))
        return
    seeds = [int(s) for s in names(args.seeds)]
    for mix in names(args.mixes):
        if mix not in DEMAND_MIXES:
            raise UnknownNameError("demand mix", mix, DEMAND_MIXES)
    t_start, rows = time.perf_counter(), []
    for scn_name, mix in ((s, m) for s in names(args.scenarios) for m in names(args.mixes)):
        base = load_scenario(scn_name)
        label = scn_name if mix == "uniform" else f"{scn_name}:{mix}"
        for rule in names(args.rules):
            scn_rule = mixed_scenario(with_rule(base, rule), mix)
            templates = library_templates(scn_rule)  # once per (scenario, rule): availability is not in its key
            for prices in names(args.prices):
                table = price_table(prices)
                for level in (float(x) for x in names(args.levels)):
                    for gp in (float(x) for x in names(args.gpu_powers)):
                        for sp in (float(x) for x in names(args.size_powers)):
                            scn = replace(scn_rule, availability_model=base.availability_model.with_shape(gp, sp))
                            market = scn.market(availability_scale=level, prices=table, window=0)
                            results = {m: method_result(scn, m, templates, market, args, seeds, rule == "slo")
                                       for m in names(args.methods)}
                            rows.append(cell_row(label, rule, prices, gp, sp, level, results))
                            r = rows[-1]
                            print(" | ".join(str(x) for x in (
                                label, rule, prices, gp, sp, level, _fmt(r.get("coral_usd_per_hour")),
                                *(_fmt(r.get(f"{b}_x_coral")) if r.get(f"{b}_served_share") is None
                                  else f"serves {r[f'{b}_served_share']:.1%}" for b in BASELINES),
                                _fmt(r.get("mixed_share")), r["binding"][:90])), flush=True)
    words = describe(rows)
    print("\n".join(words))
    out = args.out or RESULTS / "heterogeneity.json"
    png = out.with_suffix(".png")
    heat_map(rows, png)
    path = write_result("heterogeneity", {
        "wall_s": time.perf_counter() - t_start, "settings": vars(args) | {"out": str(out)}, "png": str(png),
        "where_mixing_pays": words, "headline": headline(rows, (1.0, 1.0, "list", 1.0)), "rows": rows}, out=out)
    print(f"wrote {path} and {png} in {time.perf_counter() - t_start:,.0f} s")


def _fmt(x) -> str:
    return "-" if x is None else f"{x:,.3f}"


if __name__ == "__main__":
    main()
