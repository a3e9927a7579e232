"""The day's timeline: demand and capacity, cost, and attainment per re-plan window, one method per line."""

from __future__ import annotations

from typing import Sequence

from coral_dagster.day.loop import DayResult


def timeline_png(results: Sequence[DayResult]) -> bytes:
    """Three stacked panels over the day's hours: demand (dashed) and capacity up, $ per hour, worst-model
    attainment and served share."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    for i, res in enumerate(results):
        hours = [w.start_min / 60.0 for w in res.windows]
        color = f"C{i}"
        if i == 0:
            axes[0].step(hours, [w.demand_tokens_per_s for w in res.windows], where="post", color="k",
                         linestyle="--", label="demand")
        axes[0].step(hours, [w.capacity_tokens_per_s for w in res.windows], where="post", color=color,
                     label=f"{res.method} capacity")
        per_hour = 60.0 / res.replan_interval_min
        axes[1].step(hours, [w.cost_usd * per_hour for w in res.windows], where="post", color=color,
                     label=f"{res.method} ${res.usd_per_million_slo_tokens:,.2f}/M SLO tokens")
        axes[2].step(hours, [w.worst_attainment for w in res.windows], where="post", color=color,
                     label=f"{res.method} worst model")
    axes[0].set_ylabel("tokens/s")
    axes[1].set_ylabel("$ per hour")
    axes[2].set_ylabel("attainment")
    axes[2].set_ylim(0, 1.05)
    axes[2].set_xlabel("hour of the day (UTC)")
    for ax in axes:
        ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{results[0].scenario} through a day" if results else "a day")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
