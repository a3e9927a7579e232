"""What mixing GPU types inside one replica buys, per model and phase: the best tokens/s per $ of a mixed template
(≥ 2 GPU types) beside the best homogeneous one (one GPU type, any node count), in the region where each is
cheapest, with what bounds each (compute, memory, SLO, network).

Templates come from the stored library (`coral templates build --scenario S` first), prices and availability from
the scenario's market at window 0 (data/scenarios/MARKET.md): a template counts in a region only when the region
sells each of its nodes (its menu) and has as many of each as one replica needs (its availability). A ratio above
1 is what the mixed space adds to the homogeneous one for one replica; how many replicas availability allows, and
what the ILP gains from it, is `bench.heterogeneity`'s map. Prints a table and writes bench/results/mixing.json.

    python -m bench.mixing [--scenarios core,extended,helix]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.store import Store
from coral_dagster.templates.library import load_library

RESULTS = Path(__file__).resolve().parent / "results" / "mixing.json"


def per_dollar(template, market) -> tuple[float, str, float]:
    """(tokens/s per $/h, region, $/h) of the template in the region where it is cheapest among those that sell
    and have its nodes (0 when none does)."""
    best = (0.0, "-", math.inf)
    for region in market.regions:
        if not all(market.offer(region, n) and k <= market.availability(region, n) for n, k in template.nodes.counts):
            continue
        usd = sum(k * market.price(region, n) for n, k in template.nodes.counts)
        if usd > 0 and template.tokens_per_s / usd > best[0]:
            best = (template.tokens_per_s / usd, region, usd)
    return best


def mixing_rows(scenario_name: str, store: Store) -> list[dict]:
    """One row per (model, phase) of the scenario's library: best mixed vs best homogeneous tokens/s per $."""
    scn = load_scenario(scenario_name)
    market = scn.market(window=0)
    best: dict[tuple[str, str, bool], tuple[float, object, str, float]] = {}
    for t in load_library(store, scn):
        if t.tokens_per_s <= 0:
            continue
        mixed = len({n.gpu for n, _ in t.nodes.counts}) > 1
        value, region, usd = per_dollar(t, market)
        key = (t.model, t.phase, mixed)
        if value > best.get(key, (0.0,))[0]:
            best[key] = (value, t, region, usd)
    rows = []
    for model, phase in sorted({(m, p) for m, p, _ in best}):
        mix, homo = best.get((model, phase, True)), best.get((model, phase, False))
        row = {"scenario": scn.name, "model": model, "phase": phase}
        for label, found in (("mixed", mix), ("homogeneous", homo)):
            row[f"{label}_nodes"] = str(found[1].nodes) if found else None
            row[f"{label}_tokens_per_s_per_usd"] = round(found[0], 3) if found else None
            row[f"{label}_bound"] = found[1].bound if found else None
            row[f"{label}_region"] = found[2] if found else None
        row["mixed_over_homogeneous"] = round(mix[0] / homo[0], 3) if mix and homo else None
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="core,extended,helix")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    store, rows = Store(), []
    for name in (s for s in args.scenarios.split(",") if s):
        found = mixing_rows(name, store)
        if not found:
            print(f"{name}: no library stored in {store.path} (run `coral templates build --scenario {name}`)")
        rows += found
    header = ("scenario", "model", "phase", "mixed_nodes", "mixed_tokens_per_s_per_usd", "mixed_bound",
              "homogeneous_nodes", "homogeneous_tokens_per_s_per_usd", "homogeneous_bound", "mixed_over_homogeneous")
    print(" | ".join(header))
    for r in rows:
        print(" | ".join("-" if r[k] is None else f"{r[k]:,}" if isinstance(r[k], float) else str(r[k])
                         for k in header))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"db": str(store.path), "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
