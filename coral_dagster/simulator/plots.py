"""PNG figures of a simulation: latency CDFs against the SLOs and goodput over time."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from coral_dagster.files import write_figure
from coral_dagster.simulator.result import SimResult

PLOTS_FIX = "pass another folder as --plots"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdf(result: SimResult, path: str | Path) -> Path:
    """TTFT, mean TPOT and end-to-end latency CDFs per model (completed requests), SLOs dashed."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    done = result.requests[result.requests.status == "completed"]
    slos = result.by_model.set_index("model")
    for i, model in enumerate(result.by_model.model):
        sub = done[done.model == model]
        color = f"C{i % 10}"
        for ax, col, slo in ((axes[0], "ttft_ms", "prefill_slo_ms"), (axes[1], "tpot_ms", "decode_slo_ms"),
                             (axes[2], "e2e_ms", None)):
            values = np.sort(sub[col].to_numpy())
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", color=color, label=model)
            if slo:
                ax.axvline(slos.loc[model, slo], color=color, linestyle="--", linewidth=0.8)
    for ax, title in zip(axes, ("time to first token (ms)", "mean time per output token (ms)", "end to end (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{result.scenario} / {result.method}: latency CDF ({result.arrivals}, x{result.rate_scale:g}, "
                 f"SLO attainment {result.attainment:.1%})")
    fig.tight_layout()
    try:
        return write_figure(fig, path, fix=PLOTS_FIX)
    finally:
        plt.close(fig)


def plot_goodput(result: SimResult, path: str | Path, bin_s: float = 30.0) -> Path:
    """Goodput (tokens/s of requests that met their SLO) per model over completion time."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.2))
    timeline = result.goodput_timeline(bin_s)
    for i, model in enumerate(result.by_model.model):
        sub = timeline[timeline.model == model]
        ax.plot(sub.t_s + bin_s / 2, sub.goodput_tokens_per_s, color=f"C{i % 10}", label=model)
    ax.axvline(result.duration_s, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("time (s); arrivals stop at the dotted line")
    ax.set_ylabel(f"goodput (tokens/s, {bin_s:g} s bins)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{result.scenario} / {result.method}: goodput over time ({result.arrivals}, x{result.rate_scale:g})")
    fig.tight_layout()
    try:
        return write_figure(fig, path, fix=PLOTS_FIX)
    finally:
        plt.close(fig)
