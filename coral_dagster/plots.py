"""Plots people would rather look at than read: cost per model by method, and plan cost over time."""

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


def _png(fig, plt) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def markdown_image(png: bytes, alt: str) -> str:
    """An inline markdown image, which the Dagster UI renders in metadata."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"
