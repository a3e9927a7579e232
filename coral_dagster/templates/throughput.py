"""T̂ tables the placement optimizer works on: per stage count S, node configuration and layer count.

Latency rule (ours, beyond the paper's even split). An S-stage pipeline gives every stage the budget ℓ/S. When
S > 1 a stage's time also includes sending its output activations (tokens × `activation_bytes_per_token`) to the
next stage over min(the node's NIC, the scenario's `link_gbps`); a single stage sends nothing. The rule charges
every stage of a multi-stage pipeline the transfer (the last one hands its output or KV cache on too), so T̂
depends only on (configuration, j, S) and not on the stage's position: the optimizer is exact for this rule, and
the stage times of any placement sum to at most S · ℓ/S = ℓ.

Planning under load (the knobs of `Workload`, read from the scenario's `templates:` section). A T̂ that fills
the whole budget holds the SLO only at an empty queue; the planned throughput is what a node sustains within the
SLO under load, so:
- every stage step is planned within `slo_margin` × ℓ/S (room for the batch to grow with arrival jitter);
- a node of an S-stage pipeline holds the KV cache of S micro-batches in flight;
- prefill batches are made of prompts of the trace's token-weighted mean length E[P²]/E[P] (the prompt a prefill
  token belongs to on average, which sets the attention cost per token);
- prefill T̂ is the rate at which the pipeline keeps its TTFT: a prefill node working at μ tokens/s (T̂'s batch B
  within a step of f · slo_margin · ℓ_p / S, f in `PREFILL_STEP_FRACTIONS`; no more than the engine's price of a
  token-weighted prompt in chunks of B, later chunks attending to earlier ones) is an M/G/1 FIFO queue whose service
  is the trace's prompt length / μ (`templates.queueing`). Chunks stream through the stages, so a prompt's TTFT is
  the sojourn at its slowest stage plus about one step per stage (the wait for a running step, the other stages'
  pass): the queue gets slo_margin · ℓ_p less S steps. T̂ = ρ*·μ, ρ* the highest utilisation at which a share
  `attainment_target` of prompts finish within that, best over f (T̂ = 0, `slo`, when the trace's long prompts
  overrun it at any load). The nodes of a data-parallel stage get arrivals in proportion to T̂, so each runs at ρ*
  of its own μ;
- as vLLM refuses to start when its KV cache cannot hold one sequence of `max_model_len`, a node whose KV cache
  cannot hold the trace's longest request (`max_context_tokens`) gets no layers (`memory`).
The defaults (margin 1.0, the mean prompt, no trace: prompts all of that length, no longest request, no short
output) keep the paper's budget.

Decode hand-off. A decode request first receives its prompt's KV cache: every node of a decode stage receives its
own j layers of it (h_j ms per prompt token over min(NIC, `link_gbps`)), then waits up to one pipeline cycle
c = S · step to join a micro-batch; its TPOT spreads both over its D − 1 later tokens. Concurrent transfers share
the NIC (the simulator's processor sharing), so the node's NIC is an M/G/1-PS server of KV transfers plus the
activations arriving every cycle (S > 1), and a transfer of x ms takes x/(1 − ρ) on average at utilisation ρ:
`queueing.handoff_utilisation` gives the highest ρ* at which all but (1 − `attainment_target`)/2 of the trace's
requests (their own prompt and output lengths) keep the TPOT within `slo_margin` × ℓ (half the misses: a request
also misses when the running sequences overflow the batch, and with the whole share both together missed 9% on a
helix six-stage decode). T̂ is capped at the token rate that loads the
NIC to ρ*: ρ* / (E[P]·h_j / E[D] + a), a the activation ms per token. A first version charged the hand-off only in
a short request's TPOT at an idle NIC, not as NIC load; its planned rates kept 10 Gb/s helix NICs 60–100% busy.
The step is the best of the fractions `DECODE_STEP_FRACTIONS` of slo_margin · ℓ/S: a shorter step leaves the
hand-off more room, a longer one batches more (bound `network` when the NIC cap binds). The KV cache is checked in
tokens, not only sequences: the resident sequences (Poisson many, each held from its hand-off through its E[D]
cycles) must fit it with probability `attainment_target` (`queueing.trace_kv_sequences`; the trace's long prompts
fill a cache sized for mean contexts: a KV-bound helix 1xA100:4 goes from 281 to 240 tokens/s).

Phases. `prefill`: prompt tokens/s within the prefill SLO, prompts of `Workload.prefill_seq_tokens`.
`decode`: output tokens/s with each iteration within the per-token SLO, at a context of mean prompt + half the mean output.
`aggregated` (one instance serves whole requests): each stage iteration is a slot of ℓ_d/S (ℓ_d = decode
per-token SLO) split into a prefill chunk within β·ℓ_d/S and a decode step within (1-β)·ℓ_d/S. A slot admits C
prompt tokens (the prefill batch) and emits B output tokens (the decode batch), under the same queueing rules as
the pure phases: prompts queue for C·S/ℓ_d tokens/s as in prefill (an M/G/1 queue keeping a share
`attainment_target` of first tokens within slo_margin · ℓ_p less S slots), and running sequences must fit the S·B
decode places with that probability (a cycle of S slots: their number is Poisson, λ_B the rate that holds).
T̂ = min(ρ*·(C·D/P)/(ℓ_d/S), λ_B) output tokens/s for requests of P prompt and D output tokens, the best over β in
`AGGREGATED_PREFILL_FRACTIONS`. Every decode token waits at most one slot per stage, so the per-token SLO holds
while the places suffice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Protocol

import numpy as np
import pandas as pd

from coral_dagster.catalog.gpus import node_spec
from coral_dagster.catalog.nodes import NodeConfig
from coral_dagster.errors import CoralError, UnknownNameError
from coral_dagster.templates.queueing import (decode_rate, handoff_utilisation, prefill_utilisation, trace_kv_sequences,
                                              trace_lengths)
from coral_dagster.vocab import PHASES, Phase

#: Shares of an aggregated slot given to the prefill chunk; T̂ is the best of them.
AGGREGATED_PREFILL_FRACTIONS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
#: Shares of the prefill budget the S steps of a prompt's pass may take; the rest is the prompts' queueing room.
PREFILL_STEP_FRACTIONS: tuple[float, ...] = (0.5, 0.25, 0.125, 0.0625)
#: Shares of a decode stage's budget slo_margin · ℓ/S its step may take, longest first; the rest is hand-off room.
DECODE_STEP_FRACTIONS: tuple[float, ...] = (0.97, 0.95, 0.93, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5, 0.4, 0.3)


class ThroughputPointLike(Protocol):
    tokens_per_s: float
    batch: int
    stage_ms: float
    bound: str


class PerfLike(Protocol):
    """What the optimizer needs of the performance model (`coral_dagster.profiles.perf.PerfModel`)."""

    def t_hat(self, model, node, phase, layers, budget_ms, context_tokens=0, send_gbps=None, *,
              resident_batches=1) -> ThroughputPointLike:
        ...


@dataclass(frozen=True)
class Workload:
    """What one (model, phase, SLO) asks of a node: the latency budget, request lengths and network cap.

    `prefill_seq_tokens`: prompt length prefill batches are made of (0: `prompt_tokens`); `slo_margin`: share
    of each stage's budget ℓ/S a step is planned at; `trace`: the bundled trace whose prompt lengths the prefill
    queue serves ("": all of `prefill_seq_tokens`); `attainment_target`: share of prompts that must meet it;
    `max_context_tokens`: KV tokens every node must hold for the longest request (0: no such check).
    """

    model: str
    phase: Phase
    slo_ms: float
    prompt_tokens: int
    output_tokens: int
    prefill_slo_ms: float
    link_gbps: float | None = None
    prefill_seq_tokens: int = 0
    slo_margin: float = 1.0
    trace: str = ""
    attainment_target: float = 0.95
    max_context_tokens: int = 0

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise UnknownNameError("phase", self.phase, PHASES)
        if self.slo_ms <= 0 or self.prefill_slo_ms <= 0:
            raise CoralError(f"SLO of {self.slo_ms:g} ms for {self.model} {self.phase}.", "give a positive SLO.")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise CoralError(
                f"request lengths {self.prompt_tokens}/{self.output_tokens} tokens.", "give at least 1 token each."
            )
        if not 0 < self.slo_margin <= 1:
            raise CoralError(f"slo_margin of {self.slo_margin:g} for {self.model}.", "give a slo_margin in (0, 1].")
        if not 0 < self.attainment_target < 1:
            raise CoralError(f"attainment_target of {self.attainment_target:g} for {self.model}.",
                             "give an attainment_target in (0, 1), e.g. 0.95.")
        if not self.prefill_seq_tokens:
            object.__setattr__(self, "prefill_seq_tokens", self.prompt_tokens)

    @property
    def decode_context_tokens(self) -> int:
        """Mean context of a decode step: the prompt plus half the output generated so far."""
        return self.prompt_tokens + self.output_tokens // 2


@lru_cache(maxsize=None)
def trace_mean_tokens(trace: str) -> tuple[int, int]:
    """(mean prompt tokens, mean output tokens) of a bundled trace, rounded."""
    from coral_dagster.catalog.traces import trace_means

    prompt, output = trace_means(trace)
    return round(prompt), round(output)


@lru_cache(maxsize=None)
def longest_request_tokens(trace: str) -> int:
    """Prompt plus output tokens of a bundled trace's longest request."""
    from coral_dagster.catalog.traces import load_trace

    df = load_trace(trace)
    return int((df.prompt_tokens + df.output_tokens).max())


@lru_cache(maxsize=None)
def token_weighted_prompt_tokens(trace: str) -> int:
    """E[P²]/E[P] of a bundled trace's prompts: the mean length of the prompt a prefilled token belongs to."""
    from coral_dagster.catalog.traces import load_trace

    prompt = load_trace(trace).prompt_tokens.to_numpy(dtype=np.float64)
    return round(float((prompt * prompt).sum() / prompt.sum()))


def workload_for(scenario_model, phase: Phase, link_gbps: float | None = None,
                 slo_ms: float | None = None) -> Workload:
    """The workload of one scenario model in one phase; `slo_ms` overrides the scenario's SLO of that phase
    (for aggregated, the per-token SLO; the prefill SLO still bounds the first token)."""
    prompt, output = trace_mean_tokens(scenario_model.trace)
    default = scenario_model.prefill_slo_ms if phase == "prefill" else scenario_model.decode_slo_ms
    return Workload(scenario_model.model, phase, float(slo_ms if slo_ms is not None else default), prompt, output,
                    float(scenario_model.prefill_slo_ms), link_gbps,
                    prefill_seq_tokens=token_weighted_prompt_tokens(scenario_model.trace),
                    slo_margin=float(getattr(scenario_model, "slo_margin", 1.0)),
                    trace=scenario_model.trace,
                    attainment_target=float(getattr(scenario_model, "attainment_target", 0.95)),
                    max_context_tokens=longest_request_tokens(scenario_model.trace))


@lru_cache(maxsize=8)
def perf_for_prompt(prompt_tokens: int):
    """The shipped performance model with prefill batches made of prompts of `prompt_tokens` tokens."""
    from coral_dagster.profiles.fit import load_fit
    from coral_dagster.profiles.measured import load_measured
    from coral_dagster.profiles.perf import PerfModel

    return PerfModel(load_fit(), load_measured(), prefill_seq_tokens=int(prompt_tokens))


@dataclass(frozen=True)
class Point:
    """One T̂ entry with its evidence: batch (tokens or sequences per stage step), stage time and what bound it."""

    tokens_per_s: float
    batch: int
    stage_ms: float
    bound: str


ZERO_SLO = Point(0.0, 0, 0.0, "slo")


@dataclass(frozen=True)
class ThroughputTables:
    """T̂ for S = 1..max_stages: `tokens_per_s[S][i, j-1]` for configuration `configs[i]` holding j layers."""

    workload: Workload
    configs: tuple[NodeConfig, ...]
    n_layers: int
    tokens_per_s: dict[int, np.ndarray]
    points: dict[int, tuple[tuple[Point, ...], ...]]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {c: i for i, c in enumerate(self.configs)})

    def budget_ms(self, n_stages: int) -> float:
        """The time one stage step of an `n_stages` pipeline is planned within."""
        return self.workload.slo_ms * self.workload.slo_margin / n_stages

    def index(self, node: NodeConfig) -> int:
        i = self._index.get(node)  # type: ignore[attr-defined]
        if i is None:
            raise UnknownNameError("node configuration in this table", str(node), [str(c) for c in self.configs])
        return i

    def rows(self, nodes: tuple[NodeConfig, ...]) -> dict[int, np.ndarray]:
        """Sub-tables for the configurations `nodes`, in that order."""
        idx = [self.index(n) for n in nodes]
        return {s: t[idx] for s, t in self.tokens_per_s.items()}

    def point(self, n_stages: int, node: NodeConfig, layers: int) -> Point:
        return self.points[n_stages][self.index(node)][layers - 1]

    def to_frame(self, nodes: tuple[NodeConfig, ...] | None = None, max_stages: int | None = None) -> pd.DataFrame:
        """`{stages, node, layers, tokens_per_s, batch, stage_ms, bound}` rows, the optimizer's whole input."""
        rows = []
        for s in sorted(self.points):
            if max_stages is not None and s > max_stages:
                continue
            for node in nodes or self.configs:
                for j, p in enumerate(self.points[s][self.index(node)], start=1):
                    rows.append({"stages": s, "node": str(node), "layers": j, "tokens_per_s": p.tokens_per_s,
                                 "batch": p.batch, "stage_ms": p.stage_ms, "bound": p.bound})
        return pd.DataFrame(rows, columns=["stages", "node", "layers", "tokens_per_s", "batch", "stage_ms", "bound"])


def send_gbps(node: NodeConfig, n_stages: int, link_gbps: float | None) -> float | None:
    """Bandwidth a stage sends its activations over: none for one stage, else min(NIC, scenario link)."""
    if n_stages == 1:
        return None
    nic = node_spec(node).nic_gbps
    return nic if link_gbps is None else min(nic, float(link_gbps))


def _aggregated_point(perf: PerfLike, model, node: NodeConfig, w: Workload, layers: int, n_stages: int,
                      send: float | None) -> Point:
    slot_ms = w.slo_ms * w.slo_margin / n_stages
    best = ZERO_SLO
    for beta in AGGREGATED_PREFILL_FRACTIONS:
        pre = perf.t_hat(model, node, "prefill", layers, beta * slot_ms, w.prompt_tokens, send,
                         resident_batches=n_stages)
        dec = perf.t_hat(model, node, "decode", layers, (1 - beta) * slot_ms, w.decode_context_tokens, send,
                         resident_batches=n_stages)
        if pre.tokens_per_s <= 0 or dec.tokens_per_s <= 0:
            continue
        prompt_tokens_per_s = pre.batch * 1000.0 / slot_ms
        queue_ms = w.prefill_slo_ms * w.slo_margin - n_stages * slot_ms
        busy = prefill_utilisation(w.trace, w.prefill_seq_tokens, prompt_tokens_per_s * queue_ms / 1000.0,
                                   w.attainment_target)
        via_prefill = busy * prompt_tokens_per_s * w.output_tokens / w.prompt_tokens
        via_decode = decode_rate(n_stages * slot_ms, 0.0, n_stages * int(dec.batch), w.attainment_target)
        tokens_per_s = min(via_prefill, via_decode)
        if tokens_per_s > best.tokens_per_s:
            bound = pre.bound if via_prefill < via_decode else dec.bound
            best = Point(tokens_per_s, int(tokens_per_s * slot_ms / 1000.0), pre.stage_ms + dec.stage_ms, bound)
    if best is ZERO_SLO:
        # Say why it is zero: memory when the weights cannot sit on the node at all.
        dec = perf.t_hat(model, node, "decode", layers, slot_ms, w.decode_context_tokens, send,
                         resident_batches=n_stages)
        return Point(0.0, 0, 0.0, dec.bound if dec.tokens_per_s <= 0 else "slo")
    return best


def build_tables(workload: Workload, configs: tuple[NodeConfig, ...], max_stages: int,
                 perf: PerfLike | None = None, model_spec=None) -> ThroughputTables:
    """T̂ of every configuration at every layer count for S = 1..max_stages under the latency rule above."""
    from coral_dagster.catalog.models import get_model

    spec = model_spec or get_model(workload.model)
    perf = perf or perf_for_prompt(workload.prefill_seq_tokens)
    n_layers = spec.n_layers
    max_layers = {c: _max_layers(perf, spec, c, n_layers, workload.max_context_tokens) for c in configs}
    tokens, points = {}, {}
    for s in range(1, max_stages + 1):
        rows = []
        for c in configs:
            send = send_gbps(c, s, workload.link_gbps)
            row = []
            for j in range(1, n_layers + 1):
                if j > max_layers[c]:
                    row.append(Point(0.0, 0, 0.0, "memory"))
                elif workload.phase == "aggregated":
                    row.append(_aggregated_point(perf, spec, c, workload, j, s, send))
                elif workload.phase == "prefill":
                    row.append(_prefill_point(perf, spec, c, workload, j, s, send))
                else:
                    row.append(_decode_handoff_point(perf, spec, c, workload, j, s, send))
            rows.append(tuple(row))
        points[s] = tuple(rows)
        tokens[s] = np.array([[p.tokens_per_s for p in r] for r in rows], dtype=np.float64).reshape(len(configs), n_layers)
    return ThroughputTables(workload, tuple(configs), n_layers, tokens, points)


def _prefill_point(perf: PerfLike, spec, node: NodeConfig, w: Workload, layers: int, n_stages: int,
                   send: float | None) -> Point:
    """Prefill T̂ under the queueing rule of the module docstring: the best ρ*·μ over the step budgets."""
    budget = w.slo_ms * w.slo_margin
    best, bound = ZERO_SLO, "slo"
    for fraction in PREFILL_STEP_FRACTIONS:
        p = perf.t_hat(spec, node, "prefill", layers, fraction * budget / n_stages, w.prompt_tokens, send,
                       resident_batches=n_stages)
        if p.tokens_per_s <= 0:
            bound = p.bound if p.bound == "memory" else bound
            continue
        served = min(p.tokens_per_s, _chunked_tokens_per_s(perf, spec, node, layers, w.prefill_seq_tokens, p.batch,
                                                           send))
        left_tokens = served * (budget - n_stages * p.stage_ms) / 1000.0
        rate = prefill_utilisation(w.trace, w.prefill_seq_tokens, left_tokens, w.attainment_target) * served
        if rate > best.tokens_per_s:
            best = Point(float(rate), int(p.batch), float(p.stage_ms), str(p.bound))
    return best if best.tokens_per_s > 0 else Point(0.0, 0, 0.0, bound)


def _decode_point(perf, spec, node: NodeConfig, w: Workload, layers: int, n_stages: int, send: float | None,
                  p: ThroughputPointLike, handoff_ms: float = 0.0) -> Point:
    """Decode T̂: the rate at which the node's running sequences fit its S micro-batches of T̂'s batch B with
    probability `attainment_target` (`queueing.decode_rate`), its cycle S · step(N / S) taken linear in N between one
    sequence and B per micro-batch; a perf model without curves gives a cycle fixed at S · step(B). With a trace and
    a perf model that knows KV capacity, also the rate at which the contexts of the resident sequences (a Poisson
    number of them, each from its KV hand-off of `handoff_ms` on average through its E[D] cycles) fit the node's KV
    cache with that probability (`queueing.trace_kv_sequences`: long prompts fill it sooner than the mean one)."""
    if p.tokens_per_s <= 0:
        return Point(0.0, 0, 0.0, str(p.bound))
    curve = getattr(perf, "curve", None)
    if curve is None or p.batch < 2:
        idle_ms, per_seq_ms = n_stages * p.stage_ms, 0.0
    else:
        per_unit_ms = 0.0 if not send else spec.activation_bytes_per_token * 8 / (send * 1e9) * 1e3
        one_ms = layers * curve(spec, node, "decode", max(w.decode_context_tokens, 1))(1) + per_unit_ms
        per_seq_ms = max(p.stage_ms - one_ms, 0.0) / (p.batch - 1)
        idle_ms = n_stages * (one_ms - per_seq_ms)
    rate = decode_rate(max(idle_ms, 1e-6), per_seq_ms, n_stages * int(p.batch), w.attainment_target)
    kv: Callable | None = getattr(perf, "kv_capacity_tokens", None)
    if kv is not None and w.trace:
        resident = trace_kv_sequences(w.trace, kv(spec, node, layers), w.attainment_target)
        hold_ms = w.output_tokens * n_stages * p.stage_ms + handoff_ms
        rate = min(rate, resident * w.output_tokens * 1000.0 / hold_ms)
    return Point(min(rate, float(p.tokens_per_s)), int(p.batch), float(p.stage_ms), str(p.bound))


def _chunked_tokens_per_s(perf, spec, node: NodeConfig, layers: int, prompt_tokens: int, chunk_tokens: int,
                          send: float | None) -> float:
    """Tokens/s of prompts of `prompt_tokens` prefilled in chunks of `chunk_tokens`, each later chunk attending to
    the earlier ones (`profiles.stage_times.ProfileStage.prompt_ms`, the engine's price), plus sending the activations;
    infinite for a perf model without per-layer prefill times (the T̂ batch then stands alone)."""
    if not hasattr(perf, "prefill_ms_per_layer"):
        return math.inf
    from coral_dagster.profiles.stage_times import ProfileStage

    ms = ProfileStage(perf, spec, node, layers, math.inf).prompt_ms(prompt_tokens, max(chunk_tokens, 1))
    if send:
        ms += prompt_tokens * spec.activation_bytes_per_token * 8 / (send * 1e9) * 1e3
    return 1000.0 * prompt_tokens / ms


def _decode_handoff_point(perf, spec, node: NodeConfig, w: Workload, layers: int, n_stages: int,
                          send: float | None) -> Point:
    """Decode T̂ under the hand-off rule of the module docstring: the best over step fractions of the smaller of
    the node's compute T̂ (`_decode_point`) and its NIC cap."""
    nic = node_spec(node).nic_gbps
    gbps = nic if w.link_gbps is None else min(nic, float(w.link_gbps))
    h_ms = layers * spec.kv_bytes_per_layer(1) * 8 / (gbps * 1e9) * 1e3
    act_ms = 0.0 if n_stages == 1 else spec.activation_bytes_per_token * 8 / (gbps * 1e9) * 1e3
    prompts, outputs = trace_lengths(w.trace) if w.trace else (np.array([w.prompt_tokens]), np.array([w.output_tokens]))
    tpot_ms = w.slo_ms * w.slo_margin
    # Half the misses (module docstring): the running sequences' overflow of the batch takes its own.
    handoff_target = 1.0 - (1.0 - w.attainment_target) / 2
    best = Point(0.0, 0, 0.0, "network")
    for fraction in DECODE_STEP_FRACTIONS:
        step = fraction * tpot_ms / n_stages
        rho = handoff_utilisation(prompts, outputs, h_ms, n_stages * step, tpot_ms, handoff_target)
        if rho <= 0:
            continue
        nic_cap = rho * 1000.0 / (w.prompt_tokens * h_ms / w.output_tokens + act_ms)
        if nic_cap <= best.tokens_per_s:
            continue
        handoff_ms = w.prompt_tokens * h_ms / (1.0 - rho)  # the mean PS sojourn at the NIC's highest load
        p = _decode_point(perf, spec, node, w, layers, n_stages, send,
                          perf.t_hat(spec, node, "decode", layers, step, w.decode_context_tokens, send,
                                     resident_batches=n_stages), handoff_ms)
        if p.tokens_per_s <= 0:
            best = best if best.tokens_per_s > 0 else p
            break  # shorter steps batch no more
        point = p if p.tokens_per_s <= nic_cap else Point(nic_cap, p.batch, p.stage_ms, "network")
        if point.tokens_per_s > best.tokens_per_s:
            best = point
        if p.tokens_per_s <= nic_cap:
            break  # compute binds: shorter steps only lower it
    return best


def _max_layers(perf, spec, node: NodeConfig, n_layers: int, min_kv_tokens: int = 0) -> int:
    """Layers that fit with KV room for `min_kv_tokens`; a perf model without `max_layers` is asked per layer
    count instead, and one without `kv_capacity_tokens` is not asked about KV room."""
    fn: Callable | None = getattr(perf, "max_layers", None)
    most = min(int(fn(spec, node)), n_layers) if fn is not None else n_layers
    kv: Callable | None = getattr(perf, "kv_capacity_tokens", None)
    if min_kv_tokens and kv is not None:
        # KV capacity falls as layers grow (more weights, more KV per token): the first misfit ends the range.
        for j in range(1, most + 1):
            if kv(spec, node, j) < min_kv_tokens:
                return j - 1
    return most
