"""What the paper benches share: their command line and their table (a plan is evaluated by `app.equal_attainment`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def bench_parser(doc: str, *, scenarios: str = "core,extended", duration_s: float = 600.0,
                 methods: str = "coral,homo,homo-ilp,cauchy") -> argparse.ArgumentParser:
    """Options every paper bench takes; the evaluation seeds default to ones the closed loop never uses (seed 0)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--scenarios", default=scenarios, help="comma-separated bundled scenario names or files")
    ap.add_argument("--methods", default=methods, help="comma-separated planning methods")
    ap.add_argument("--seeds", default="11,12,13,14", help="evaluation seeds: each starts the traces elsewhere")
    ap.add_argument("--duration-s", type=float, default=duration_s, help="seconds of traffic per evaluation")
    ap.add_argument("--time-limit-s", type=float, default=30.0, help="solver limit per solve")
    ap.add_argument("--out", type=Path, default=None, help="JSON file (default: bench/results/<bench>.json)")
    return ap


def names(text: str) -> list[str]:
    """A comma-separated option as a list."""
    return [t for t in text.split(",") if t]


def seeds_and_libraries(args) -> tuple[list[int], list[tuple]]:
    """The evaluation seeds, and each `--scenarios` scenario with its stored template library."""
    from coral_dagster.app.scenario_plans import library_templates
    from coral_dagster.catalog.scenarios import load_scenario

    scenarios = [load_scenario(name) for name in names(args.scenarios)]
    return [int(s) for s in names(args.seeds)], [(scn, library_templates(scn)) for scn in scenarios]


def cell(value) -> str:
    """A table cell: floats to 3 decimals with thousands separators, missing as '-'."""
    return f"{value:,.3f}" if isinstance(value, float) else ("-" if value is None else str(value))


def report(rows: list[dict], header: tuple[str, ...], out: Path, meta: dict) -> None:
    """Print `rows` as a '|' table and write them with `meta` as JSON to `out`."""
    print(" | ".join(header))
    for r in rows:
        print(" | ".join(cell(r.get(k)) for k in header))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "rows": rows}, indent=2, default=str))
    print(f"wrote {out}")
