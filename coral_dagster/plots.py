"""Plots people would rather look at than read: cost per model by method, plan cost over time, and the allocation
benchmark's cost and goodput per method."""

from __future__ import annotations

import base64
import io

import pandas as pd

from coral_dagster.allocation.types import Plan


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def cost_by_model_png(plans: dict[str, Plan]) -> bytes:
    """Grouped bars: $/h each method spends on each model."""
    plt = _figure()
    rows = [{"method": method, "model": i.template.model, "usd_per_hour": i.count * i.usd_per_hour}
            for method, plan in plans.items() for i in plan.instances]
    df = pd.DataFrame(rows, columns=["method", "model", "usd_per_hour"])
    table = df.pivot_table(index="model", columns="method", values="usd_per_hour", aggfunc="sum", fill_value=0.0)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    table.plot.bar(ax=ax, rot=0)
    ax.set_ylabel("$ per hour")
    ax.set_title("Cost per model")
    fig.tight_layout()
    return _png(fig, plt)


def cost_over_time_png(history: pd.DataFrame) -> bytes:
    """Lines: each method's plan cost over time, from the `plan_history` view."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for method, rows in history.sort_values("created_at").groupby("method"):
        ax.plot(rows["created_at"], rows["cost_usd_per_hour"], marker="o", label=method)
    ax.set_ylabel("$ per hour")
    ax.set_title("Plan cost over time")
    ax.legend()
    fig.autofmt_xdate()
    fig.tight_layout()
    return _png(fig, plt)


def bench_png(doc: dict) -> bytes:
    """Two panels from an allocation benchmark document: each method's cost relative to Coral per setting, and
    its simulated goodput (fluid where not simulated)."""
    plt = _figure()
    rows = pd.DataFrame([r for r in doc.get("rows", []) if r.get("cost_usd_per_hour") is not None])
    if rows.empty:
        rows = pd.DataFrame(columns=["setting", "scenario", "method", "cost_ratio_to_coral", "goodput_fraction"])
    rows["setting"] = rows["scenario"] + " " + rows["setting"]
    sim = rows["goodput_sim_fraction"] if "goodput_sim_fraction" in rows else pd.Series(dtype=float)
    rows["goodput"] = sim.where(sim.notna(), rows["goodput_fraction"]) if len(sim) else rows["goodput_fraction"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for ax, column, label in ((top, "cost_ratio_to_coral", "cost / Coral's"), (bottom, "goodput", "goodput")):
        table = rows.pivot_table(index="setting", columns="method", values=column, aggfunc="first")
        table.plot.bar(ax=ax, rot=20, legend=ax is top)
        ax.set_ylabel(label)
    top.axhline(1.0, color="black", linewidth=0.8)
    top.set_title("Allocation benchmark: cost relative to Coral (top), simulated goodput (bottom)")
    fig.tight_layout()
    return _png(fig, plt)


def _png(fig, plt) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def markdown_image(png: bytes, alt: str) -> str:
    """An inline markdown image, which the Dagster UI renders in metadata."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"
