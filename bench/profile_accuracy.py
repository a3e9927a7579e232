"""Accuracy of the calibrated roofline against measured tables held out of its fit, and the speed of T̂.

Holds out, in turn, every model (all tables of one layer shape, on every GPU) and every GPU type (all of its
tables), refits on the rest, predicts the held-out rows, and prints median and p90 absolute percentage error per
GPU and phase. Writes bench/results/profile_accuracy.json.

    python bench/profile_accuracy.py [--max-nfev 60]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from coral_dagster.catalog.models import model_catalog
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.profiles import default_perf_model
from coral_dagster.profiles.accuracy import holdout_errors, in_sample_errors, summarise
from coral_dagster.vocab import DEMAND_PHASES

OUT = Path(__file__).resolve().parent / "results" / "profile_accuracy.json"
TARGET_MEDIAN_APE = 0.15


def _records(df) -> list[dict]:
    return [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in df.to_dict("records")]


def _table(title: str, df, extra: tuple[str, ...] = ()) -> Table:
    t = Table(title=title)
    for col in ("gpu", "phase", *extra, "median APE", "p90 APE", "rows"):
        t.add_column(col, justify="right" if "APE" in col or col == "rows" else "left")
    for r in df.itertuples(index=False):
        t.add_row(r.gpu, r.phase, *(str(getattr(r, c)) for c in extra), f"{100 * r.median_ape:.1f}%",
                  f"{100 * r.p90_ape:.1f}%", str(r.rows))
    return t


def t_hat_speed(calls: int = 20000) -> dict:
    """Microseconds per T̂ call over the extended scenario's models and nodes: first (cold) and repeated (warm)."""
    perf = default_perf_model()
    sc = load_scenario("extended")
    rng = random.Random(0)
    queries = [(m.model, rng.choice(sc.node_configs), rng.choice(DEMAND_PHASES), rng.randint(1, 40),
                rng.choice((25.0, 50.0, 100.0, 400.0, 900.0)), 1300) for m in sc.models for _ in range(calls // 6)]
    for q in queries[:200]:
        perf.curve(q[0], q[1], q[2], perf.prefill_seq_tokens if q[2] == "prefill" else q[5])
    start = time.perf_counter()
    for q in queries:
        perf.t_hat(*q)
    cold = (time.perf_counter() - start) / len(queries) * 1e6
    start = time.perf_counter()
    for q in queries:
        perf.t_hat(*q)
    warm = (time.perf_counter() - start) / len(queries) * 1e6
    return {"calls": len(queries), "first_call_us": round(cold, 2), "repeat_call_us": round(warm, 2),
            "curves_built": len(perf._curves)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-nfev", type=int, default=60, help="Optimiser evaluations per held-out refit.")
    args = ap.parse_args()
    console = Console(width=160)
    started = time.perf_counter()

    in_sample = in_sample_errors()
    by_model = holdout_errors("model", max_nfev=args.max_nfev, progress=lambda p: tqdm(p, desc="hold out models"))
    by_gpu = holdout_errors("gpu", max_nfev=args.max_nfev, progress=lambda p: tqdm(p, desc="hold out GPUs"))
    model_summary = summarise(by_model, ["gpu", "phase"])
    gpu_summary = summarise(by_gpu, ["gpu", "borrowed_from", "phase"])
    model_source = summarise(by_model, ["source", "phase"])
    speed = t_hat_speed()

    console.print(_table("Held-out models (every table of one layer shape left out of the fit)", model_summary))
    console.print(_table("Held-out GPU types (efficiencies borrowed from the closest class)", gpu_summary,
                         ("borrowed_from",)))
    overall_model = float(by_model["ape"].median())
    meets = bool((model_summary["median_ape"] <= TARGET_MEDIAN_APE).all())
    console.print(f"held-out models: median APE {100 * overall_model:.1f}% overall, "
                  f"p90 {100 * by_model['ape'].quantile(0.9):.1f}%; every GPU x phase median <= "
                  f"{100 * TARGET_MEDIAN_APE:.0f}%: {meets}")
    console.print(f"held-out GPUs: median APE {100 * by_gpu['ape'].median():.1f}% overall")
    console.print(f"in-sample: median APE {100 * in_sample['all']['median_ape']:.1f}%, "
                  f"p90 {100 * in_sample['all']['p90_ape']:.1f}%")
    console.print(f"T̂: {speed['first_call_us']} µs per first call, {speed['repeat_call_us']} µs per repeat "
                  f"({speed['calls']} calls, {speed['curves_built']} curves)")

    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "run_at": datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
        "wall_s": round(time.perf_counter() - started, 1), "max_nfev": args.max_nfev,
        "models_in_catalog": len(model_catalog()),
        "in_sample": in_sample,
        "held_out_models": {"by_gpu_phase": _records(model_summary), "by_source_phase": _records(model_source),
                            "median_ape": round(overall_model, 4),
                            "p90_ape": round(float(by_model["ape"].quantile(0.9)), 4),
                            "target_median_ape": TARGET_MEDIAN_APE, "meets_target": meets},
        "held_out_gpus": {"by_gpu_phase": _records(gpu_summary),
                          "median_ape": round(float(by_gpu["ape"].median()), 4),
                          "p90_ape": round(float(by_gpu["ape"].quantile(0.9)), 4)},
        "t_hat_speed": speed,
    }, indent=1) + "\n")
    console.print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
