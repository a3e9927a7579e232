"""What one simulation measured: per-request latencies, SLO attainment, goodput, cost and node utilisation."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from coral_dagster.simulator.engine import FAILURES, OK, SHED, TOO_LONG, EngineOutput
from coral_dagster.simulator.workload import Workload

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class ModelSlo:
    """A model's SLOs: time to first token (prefill) and mean time per output token (decode)."""

    model: str
    prefill_slo_ms: float
    decode_slo_ms: float


@dataclass(frozen=True)
class SimResult:
    """One run's measurements. A request meets its SLO when it completes with TTFT ≤ the prefill SLO and mean
    TPOT ≤ the decode SLO; goodput counts the prompt plus output tokens of those requests per second of the
    arrival window. Requests that fail (no instance, longer than max_model_len, unfinished at the drain limit)
    miss. Queueing delay is vLLM's queue time: from arrival to the first prefill chunk's start on the entry
    instance (`queue_ms`), and for a prefilled request from its first token to its decode instance admitting it
    (`decode_queue_ms`)."""

    scenario: str
    method: str
    arrivals: str
    duration_s: float
    seed: int
    rate_scale: float
    requests: pd.DataFrame
    by_model: pd.DataFrame
    nodes: pd.DataFrame
    cost_usd_per_hour: float
    end_s: float
    events: int
    wall_s: float

    @property
    def attainment_by_model(self) -> dict[str, float]:
        return dict(zip(self.by_model.model, self.by_model.attainment))

    @property
    def goodput_by_model(self) -> dict[str, float]:
        return dict(zip(self.by_model.model, self.by_model.goodput_tokens_per_s))

    @property
    def attainment(self) -> float:
        return float(self.requests.met_slo.mean()) if len(self.requests) else 1.0

    @property
    def goodput_tokens_per_s(self) -> float:
        return float(self.by_model.goodput_tokens_per_s.sum())

    @property
    def offered_tokens_per_s(self) -> float:
        """Prompt plus output tokens of every arrival, per second of the arrival window."""
        return float(self.requests.prompt_tokens.sum() + self.requests.output_tokens.sum()) / self.duration_s

    @property
    def served_requests_per_s(self) -> float:
        """Completed requests per second of the arrival window."""
        return float((self.requests.status == FAILURES[OK]).sum()) / self.duration_s

    @property
    def served_tokens(self) -> int:
        done = self.requests[self.requests.status == FAILURES[OK]]
        return int(done.prompt_tokens.sum() + done.output_tokens.sum())

    @property
    def usd_per_million_tokens(self) -> float:
        """The plan's cost over the arrival window per million tokens (prompt + output) of completed requests."""
        tokens = self.served_tokens
        usd = self.cost_usd_per_hour * self.duration_s / 3600.0
        return usd / tokens * 1e6 if tokens else float("inf")

    @property
    def usd_per_million_goodput_tokens(self) -> float:
        goodput = self.goodput_tokens_per_s * self.duration_s
        usd = self.cost_usd_per_hour * self.duration_s / 3600.0
        return usd / goodput * 1e6 if goodput else float("inf")

    @property
    def counts(self) -> dict[str, int]:
        """Arrivals, routed, and how each request ended (completed + failures == arrivals)."""
        status = self.requests.status.value_counts()
        out = {"arrivals": len(self.requests), "routed": int(self.requests.routed.sum())}
        out.update({name: int(status.get(name, 0)) for name in FAILURES})
        return out

    def goodput_timeline(self, bin_s: float = 30.0) -> pd.DataFrame:
        """Goodput per model in bins of completion time: columns t_s, model, goodput_tokens_per_s."""
        met = self.requests[self.requests.met_slo]
        edges = np.arange(0.0, max(self.end_s, self.duration_s) + bin_s, bin_s)
        rows = []
        for model in self.by_model.model:
            sub = met[met.model == model]
            done_s = sub.arrival_s + sub.e2e_ms / 1000.0
            tokens, _ = np.histogram(done_s, bins=edges, weights=sub.prompt_tokens + sub.output_tokens)
            rows.append(pd.DataFrame({"t_s": edges[:-1], "model": model, "goodput_tokens_per_s": tokens / bin_s}))
        return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(
            columns=["t_s", "model", "goodput_tokens_per_s"])

    def summary(self) -> dict:
        """JSON-ready headline figures and the per-model table."""
        return {
            "scenario": self.scenario, "method": self.method, "arrivals": self.arrivals,
            "duration_s": self.duration_s, "seed": self.seed, "rate_scale": self.rate_scale,
            "attainment": self.attainment, "goodput_tokens_per_s": self.goodput_tokens_per_s,
            "offered_tokens_per_s": self.offered_tokens_per_s,
            "cost_usd_per_hour": self.cost_usd_per_hour, "usd_per_million_tokens": self.usd_per_million_tokens,
            "usd_per_million_goodput_tokens": self.usd_per_million_goodput_tokens,
            "served_requests_per_s": self.served_requests_per_s, "end_s": self.end_s,
            "counts": self.counts, "events": self.events, "wall_s": self.wall_s,
            "requests_per_wall_s": len(self.requests) / self.wall_s if self.wall_s else None,
            "models": self.by_model.to_dict(orient="records"),
        }


def build_result(out: EngineOutput, workload: Workload, slos: dict[str, ModelSlo], *, scenario: str, method: str,
                 arrivals: str, seed: int, rate_scale: float, cost_usd_per_hour: float) -> SimResult:
    """Turn the engine's raw times into latencies, SLO verdicts and per-model and per-node tables."""
    arrival = workload.arrival_s
    model = np.array(workload.models, dtype=object)[workload.model] if len(workload) else np.empty(0, object)
    ok = out.status == OK
    ttft_ms = (out.ttft_s - arrival) * 1000.0
    e2e_ms = (out.finish_s - arrival) * 1000.0
    decode_tokens = workload.output_tokens - 1
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot_ms = np.where(decode_tokens > 0, (out.finish_s - out.ttft_s) * 1000.0 / np.maximum(decode_tokens, 1),
                           0.0)
    tpot_ms = np.where(ok, tpot_ms, np.nan)
    prefill_slo = np.array([slos[m].prefill_slo_ms for m in workload.models])[workload.model] \
        if len(workload) else np.empty(0)
    decode_slo = np.array([slos[m].decode_slo_ms for m in workload.models])[workload.model] \
        if len(workload) else np.empty(0)
    met = ok & (ttft_ms <= prefill_slo) & (tpot_ms <= decode_slo)
    requests = pd.DataFrame({
        "model": model, "arrival_s": arrival, "prompt_tokens": workload.prompt_tokens,
        "output_tokens": workload.output_tokens, "ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "e2e_ms": e2e_ms,
        "queue_ms": (out.scheduled_s - arrival) * 1000.0,
        "decode_queue_ms": (out.decode_admitted_s - out.ttft_s) * 1000.0,
        "status": np.array(FAILURES, dtype=object)[out.status] if len(workload) else np.empty(0, object),
        "routed": out.routed, "preemptions": out.preemptions, "met_slo": met,
    })
    horizon_s = max(out.end_s, workload.duration_s)
    nodes = pd.DataFrame(out.nodes)
    if len(nodes):
        nodes["busy_fraction"] = nodes.busy_s / horizon_s
    rows = []
    for name in workload.models:
        sub = requests[requests.model == name]
        done = sub[sub.status == FAILURES[OK]]
        good = sub[sub.met_slo]
        row = {"model": name, "prefill_slo_ms": slos[name].prefill_slo_ms, "decode_slo_ms": slos[name].decode_slo_ms,
               "arrivals": len(sub), "completed": len(done),
               "attainment": float(sub.met_slo.mean()) if len(sub) else 1.0,
               "goodput_tokens_per_s": float((good.prompt_tokens + good.output_tokens).sum()) / workload.duration_s,
               "throughput_tokens_per_s": float((done.prompt_tokens + done.output_tokens).sum()) / workload.duration_s,
               "served_requests_per_s": len(done) / workload.duration_s,
               "exceeds_max_model_len": int((sub.status == FAILURES[TOO_LONG]).sum()),
               "shed": int((sub.status == FAILURES[SHED]).sum()),
               "admitted_attainment": float(sub[sub.status != FAILURES[SHED]].met_slo.mean())
               if (sub.status != FAILURES[SHED]).any() else 1.0,
               "preemptions": int(sub.preemptions.sum())}
        for col in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms", "decode_queue_ms"):
            values = done[col].to_numpy()
            values = values[~np.isnan(values)]
            for p in PERCENTILES:
                row[f"{col[:-3]}_p{p}_ms"] = float(np.percentile(values, p)) if len(values) else float("nan")
            if col.endswith("queue_ms"):
                row[f"{col[:-3]}_mean_ms"] = float(values.mean()) if len(values) else float("nan")
        mine = nodes[nodes.model == name] if len(nodes) else nodes
        row["nodes"] = len(mine)
        row["mean_busy_fraction"] = float(mine.busy_fraction.mean()) if len(mine) else 0.0
        rows.append(row)
    return SimResult(scenario, method, arrivals, workload.duration_s, seed, rate_scale, requests, pd.DataFrame(rows),
                     nodes, cost_usd_per_hour, out.end_s, out.events, out.wall_s)
