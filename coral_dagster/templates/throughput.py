"""T̂ tables the placement optimizer works on: per stage count S, node configuration and layer count.

Two rules compute T̂ (`Workload.rule`, a scenario's `templates: {t_hat_rule: ...}`, `--t-hat-rule`):
`paper`, the paper's plain per-stage rule (coral.md §2), and `slo` (ours, the default), which holds the SLOs under
load. Under `paper` a node holding j layers of an S-stage pipeline gets T̂ = the most tokens/s any batch reaches
within ℓ/S (`PerfModel.t_hat`): no `slo_margin`, no queueing factor, no activation charge, KV room for one batch, and
no check of the trace's longest request; prefill batches are prompts of `prefill_seq_tokens`, decode batches
sequences at `Workload.decode_context_tokens`; its aggregated T̂ is at the end of this docstring, whose rest is the
`slo` rule.

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
`aggregated` (one instance serves whole requests), as vLLM runs it: chunked prefill fused into the decode step. A
step of a node runs its B running sequences (one decode token each) and up to M − B prompt tokens of waiting
prompts in one forward pass (vLLM 0.32's `vllm/v1/core/sched/scheduler.py`: `max_num_scheduled_tokens` is
`max_num_batched_tokens`; "First, schedule the RUNNING requests", then "the WAITING requests" with
`num_new_tokens = min(num_new_tokens, request_token_budget)` while fewer than `max_num_seqs` run; the CPU build's own
scheduler is checked against the simulator in tests/test_simulator_aggregated.py), so the weights are read once:
`profiles.stage_times.fused_step_ms` prices it as the decode iteration plus what the chunk adds to a pass over B tokens
(`fused_step_table`, per layer, chunks of prompts of `prefill_seq_tokens`). The per-token SLO bounds a request's
mean TPOT, not every step, so the rule works with the mean step: requests leave as fast as they enter, so a step
must take B·P/D prompt tokens on average (P, D the mean prompt and output); steps that take a chunk of M − B
tokens (time t₁) are a share q = B·P/D / (M − B) of all, the others decode alone (t₀), and the mean step
t̄ = q·t₁ + (1 − q)·t₀ must fit the slot slo_margin · ℓ_d/S (the TPOT is S·t̄). T̂ = B / t̄ output tokens/s, the best
over B in `AGGREGATED_BATCHES` and M in `AGGREGATED_TOKEN_BUDGETS` (M is stored as the stage's `batches`, vLLM's
`--max-num-batched-tokens`) such that q ≤ 1; the resident sequences (S micro-batches of B on average, Poisson)
fit `MAX_NUM_SEQS` per micro-batch at the `attainment_target` normal quantile and the KV cache with that probability
(`queueing.trace_kv_sequences`); prompts, queueing for a server of (M − B)/t₁ prompt tokens/s, keep a share
`attainment_target` of first tokens within slo_margin · ℓ_p less S busy steps (the prefill rule's M/G/1 queue); and
when a busy step overruns the slot, the requests whose own steps average over it (the busy steps they see cluster
in the prompt queue's busy periods; `_tpot_miss_share`) are at most half the misses (a first version without this
check planned gpt-oss-20b on azure-code, 28 output tokens a request, at a mean step of 8 ms whose 2048-token steps
took 72 ms: 76% attainment in the simulator).
Under `paper`: slot ℓ_d/S, no activation charge, KV for one batch of B (B · context ≤ room), and a lone prompt's
first token within ℓ_p: (⌈P/(M − B)⌉ + S − 1) busy steps. (A first version gave the chunk and the decode step
separate shares of every step, each paying the weight read, with every step within the slot: one-node L40S:2
templates of qwen3-32b and phi-4 on core served nothing, which vLLM's fused step serves.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from functools import lru_cache
from typing import Callable, Protocol

import numpy as np
import pandas as pd
from scipy.special import gammainc

from coral_dagster.catalog.gpus import node_spec
from coral_dagster.catalog.nodes import NodeConfig
from coral_dagster.errors import CoralError, UnknownNameError
from coral_dagster.templates.queueing import (decode_rate, handoff_utilisation, prefill_utilisation, trace_kv_sequences,
                                              trace_lengths)
from coral_dagster.vocab import PHASES, T_HAT_RULE_NAMES, Phase, THatRule

#: Running sequences one engine step may hold: `vllm serve`'s default `max_num_seqs` on GPUs under 70 GB (vLLM 0.32
#: `engine/arg_utils.py`; 1024 on H100/H200, so this is conservative there); deployments pass it explicitly.
MAX_NUM_SEQS = 256
#: Mean decode sequences a fused aggregated step holds, tried for T̂ (below 1: steps priced at one sequence).
AGGREGATED_BATCHES: tuple[float, ...] = (0.125, 0.25, 0.5, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160,
                                         192, 224, 256)
#: Token budgets per step (vLLM's `max_num_batched_tokens`, decode tokens included) tried for aggregated T̂.
AGGREGATED_TOKEN_BUDGETS: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192, 16384)
AGGREGATED_BATCHES_ARRAY = np.asarray(AGGREGATED_BATCHES)
#: Prompt tokens a fused aggregated step may add, tried for T̂: 0, then 2^(k/16) up to 2^18.
AGGREGATED_CHUNKS: np.ndarray = np.unique(np.concatenate([[0.0], np.round(2.0 ** (np.arange(18 * 16 + 1) / 16))])
                                          ).astype(int)
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
    `max_context_tokens`: KV tokens every node must hold for the longest request (0: no such check); `rule`: the
    T̂ rule (module docstring), `paper` ignoring the margin, the trace's queueing and the longest request.
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
    rule: THatRule = "slo"

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise UnknownNameError("phase", self.phase, PHASES)
        if self.rule not in T_HAT_RULE_NAMES:
            raise UnknownNameError("T̂ rule", self.rule, T_HAT_RULE_NAMES)
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
                 slo_ms: float | None = None, rule: THatRule = "slo") -> Workload:
    """The workload of one scenario model in one phase under T̂ rule `rule` (the scenario's `t_hat_rule`);
    `slo_ms` overrides the scenario's SLO of that phase (for aggregated, the per-token SLO; the prefill SLO still
    bounds the first token)."""
    prompt, output = trace_mean_tokens(scenario_model.trace)
    default = scenario_model.prefill_slo_ms if phase == "prefill" else scenario_model.decode_slo_ms
    return Workload(scenario_model.model, phase, float(slo_ms if slo_ms is not None else default), prompt, output,
                    float(scenario_model.prefill_slo_ms), link_gbps,
                    prefill_seq_tokens=token_weighted_prompt_tokens(scenario_model.trace),
                    slo_margin=float(getattr(scenario_model, "slo_margin", 1.0)),
                    trace=scenario_model.trace,
                    attainment_target=float(getattr(scenario_model, "attainment_target", 0.95)),
                    max_context_tokens=longest_request_tokens(scenario_model.trace), rule=rule)


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
        """The time one stage step of an `n_stages` pipeline is planned within (`paper`: ℓ/S, no margin)."""
        margin = 1.0 if self.workload.rule == "paper" else self.workload.slo_margin
        return self.workload.slo_ms * margin / n_stages

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


def build_tables(workload: Workload, configs: tuple[NodeConfig, ...], max_stages: int,
                 perf: PerfLike | None = None, model_spec=None) -> ThroughputTables:
    """T̂ of every configuration at every layer count for S = 1..max_stages under the latency rule above."""
    from coral_dagster.catalog.models import get_model

    spec = model_spec or get_model(workload.model)
    perf = perf or perf_for_prompt(workload.prefill_seq_tokens)
    n_layers = spec.n_layers
    paper = workload.rule == "paper"
    longest = 0 if paper else workload.max_context_tokens
    max_layers = {c: _max_layers(perf, spec, c, n_layers, longest) for c in configs}
    fused = {c: fused_step_table(perf, spec, c, workload) for c in configs} if workload.phase == "aggregated" else {}
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
                    act_ms = 0.0 if paper or not send else spec.activation_bytes_per_token * 8 / (send * 1e9) * 1e3
                    row.append(_aggregated_point(fused[c], _kv_tokens(perf, spec, c, j), workload, j, s, act_ms))
                elif paper:
                    row.append(_paper_point(perf, spec, c, workload, j, s))
                elif workload.phase == "prefill":
                    row.append(_prefill_point(perf, spec, c, workload, j, s, send))
                else:
                    row.append(_decode_handoff_point(perf, spec, c, workload, j, s, send))
            rows.append(tuple(row))
        points[s] = tuple(rows)
        tokens[s] = np.array([[p.tokens_per_s for p in r] for r in rows], dtype=np.float64).reshape(len(configs), n_layers)
    return ThroughputTables(workload, tuple(configs), n_layers, tokens, points)


def _paper_point(perf: PerfLike, spec, node: NodeConfig, w: Workload, layers: int, n_stages: int) -> Point:
    """Prefill or decode T̂ under the paper's rule: the best batch within ℓ/S, KV for one batch, nothing sent."""
    context = w.prompt_tokens if w.phase == "prefill" else w.decode_context_tokens
    p = perf.t_hat(spec, node, w.phase, layers, w.slo_ms / n_stages, context, None, resident_batches=1)
    return Point(float(p.tokens_per_s), int(p.batch), float(p.stage_ms), str(p.bound))


def _kv_tokens(perf, spec, node: NodeConfig, layers: int) -> float:
    """KV-cache tokens a node holding `layers` layers has room for (unbounded for a perf model that does not say)."""
    kv: Callable | None = getattr(perf, "kv_capacity_tokens", None)
    return math.inf if kv is None else float(kv(spec, node, layers))


def fused_step_table(perf, spec, node: NodeConfig, w: Workload) -> np.ndarray:
    """Milliseconds per layer of fused aggregated steps on `node` (`profiles.stage_times.fused_step_ms`, the engine's
    price): row i holds `AGGREGATED_BATCHES[i]` decode sequences (at least one) at the mean decode context, column k
    adds `AGGREGATED_CHUNKS[k]` prompt tokens, chunks of prompts of `prefill_seq_tokens` (a chunk c shorter than the
    prompt has (P − c)/2 of it cached before it on average)."""
    from coral_dagster.profiles.stage_times import ProfileStage, fused_step_ms

    lat = ProfileStage(perf, spec, node, 1, math.inf)
    ctx, prompt = w.decode_context_tokens, w.prefill_seq_tokens
    out = np.empty((len(AGGREGATED_BATCHES), len(AGGREGATED_CHUNKS)))
    for i, b in enumerate(max(1, round(b)) for b in AGGREGATED_BATCHES):
        for k, c in enumerate(AGGREGATED_CHUNKS.tolist()):
            seq = min(c, prompt) if c else 1
            out[i, k] = fused_step_ms(lat, b, b * ctx, c, seq, (prompt - c) / 2.0 if c < prompt else 0.0)
    return out


def _aggregated_point(fused: np.ndarray, kv_tokens: float, w: Workload, layers: int, n_stages: int,
                      act_ms: float) -> Point:
    """Aggregated T̂ by the fused-step rule of the module docstring (both rules; `paper` without margin, queueing or
    activation charge, one batch of KV): the best output rate B / t̄ over mean decode batches B and token budgets M."""
    paper = w.rule == "paper"
    margin = 1.0 if paper else w.slo_margin
    slot_ms = w.slo_ms * margin / n_stages
    batches = AGGREGATED_BATCHES_ARRAY.astype(float)
    steps = layers * fused + act_ms * (batches[:, None] + AGGREGATED_CHUNKS[None, :])
    idle = steps[:, 0]
    if paper:
        resident = kv_tokens / w.decode_context_tokens
    elif w.trace:
        resident = trace_kv_sequences(w.trace, kv_tokens, w.attainment_target)
    else:
        resident = kv_tokens / w.decode_context_tokens
    prompt_per_step = batches * w.prompt_tokens / w.output_tokens  # prompt tokens a step must take on average
    z = NormalDist().inv_cdf(w.attainment_target)
    best, bound = ZERO_SLO, "memory" if n_stages * w.decode_context_tokens > kv_tokens else "slo"
    for budget in AGGREGATED_TOKEN_BUDGETS:
        k = np.searchsorted(AGGREGATED_CHUNKS, budget - batches, side="right") - 1  # largest chunk ≤ M − B
        chunk = AGGREGATED_CHUNKS[np.maximum(k, 0)].astype(float)
        busy_ms = steps[np.arange(len(batches)), np.maximum(k, 0)]
        share = np.divide(prompt_per_step, chunk, out=np.full_like(chunk, np.inf), where=chunk > 0)
        within = np.minimum(share, 1.0)
        mean_ms = np.where(share <= 1.0, within * busy_ms + (1.0 - within) * idle, np.inf)
        places = n_stages * batches if paper else n_stages * batches + z * np.sqrt(n_stages * batches)
        ok = (share <= 1.0) & (mean_ms <= slot_ms) & (batches <= budget) & (places <= n_stages * MAX_NUM_SEQS)
        ok &= (batches if paper else n_stages * batches) <= resident
        for i in np.flatnonzero(ok):
            rate = 1000.0 * batches[i] / mean_ms[i]
            if rate <= best.tokens_per_s:
                continue
            prompt_rate = rate * w.prompt_tokens / w.output_tokens
            served = chunk[i] * 1000.0 / busy_ms[i]  # prompt tokens/s while prompts wait
            if paper:
                first_ms = (math.ceil(w.prompt_tokens / chunk[i]) + n_stages - 1) * busy_ms[i]
                if first_ms > w.prefill_slo_ms:
                    continue
            else:
                queue_ms = w.prefill_slo_ms * margin - n_stages * busy_ms[i]
                if prompt_rate > served * prefill_utilisation(w.trace, w.prefill_seq_tokens,
                                                              served * queue_ms / 1000.0, w.attainment_target):
                    continue
                busy = prompt_rate / served
                period = w.prompt_tokens / chunk[i] / max(1.0 - busy, 1e-9)
                if busy_ms[i] > slot_ms and _tpot_miss_share(w, share[i], period, busy, idle[i], busy_ms[i],
                                                              slot_ms) > (1.0 - w.attainment_target) / 2:
                    continue
            network = act_ms * (batches[i] + chunk[i]) > layers * fused[i, max(int(k[i]), 0)]
            best = Point(float(rate), int(budget), float(mean_ms[i]), "network" if network else "compute")
    return best if best.tokens_per_s > 0 else Point(0.0, 0, 0.0, bound)


def _tpot_miss_share(w: Workload, busy_steps: float, period_steps: float, busy_time: float, idle_ms: float,
                     busy_ms: float, slot_ms: float) -> float:
    """Share of requests (the trace's output lengths) whose own decode steps average over `slot_ms` when a share
    `busy_steps` of all steps takes a prompt chunk (`busy_ms`, else `idle_ms`): the busy steps a request of D
    tokens sees over its D − 1 steps cluster in the prompt queue's busy periods, of geometric length with mean
    m = max(1, `period_steps`) steps (M/G/1; a period is at least one step), arriving at rate `busy_steps` / m per
    step, plus the rest of the period its own prompt ended in (the queue is busy a share `busy_time` of the time:
    ρ·min(m, D − 1)/m more periods): a compound Poisson count (`polya_aeppli_cdf`); the request misses beyond
    ⌊(D − 1)(slot − t₀)/(t₁ − t₀)⌋ of them. (A normal approximation of that count said 0% for gpt-oss-20b on
    azure-code, 28 output tokens a request, where the simulator missed 14%: most requests may see no busy step.)"""
    lengths, counts = _output_lengths(w.trace, w.output_tokens)
    d1 = np.maximum(lengths - 1.0, 0.0)
    allowed = np.floor(d1 * (slot_ms - idle_ms) / (busy_ms - idle_ms))
    m = max(float(period_steps), 1.0)
    periods = (d1 * busy_steps + busy_time * np.minimum(m, d1)) / m
    miss = np.where(d1 > 0, 1.0 - polya_aeppli_cdf(allowed, periods, 1.0 / m), 0.0)
    return float((miss * counts).sum() / counts.sum())


#: Counts up to which `polya_aeppli_cdf` sums the exact probabilities; beyond, a translated gamma.
POLYA_AEPPLI_EXACT = 64


def polya_aeppli_cdf(k: np.ndarray, mu: np.ndarray, p: float) -> np.ndarray:
    """P(N ≤ k) for N a Poisson(μ) number of geometric counts on {1, 2, …} with success probability p (mean 1/p):
    exact by the recursion n·Pₙ = (μp + 2q(n − 1))·Pₙ₋₁ − q²(n − 2)·Pₙ₋₂ (q = 1 − p) up to
    `POLYA_AEPPLI_EXACT`, above it the translated gamma with N's first three cumulants μ/p, μ(2 − p)/p² and
    μ(6 − 6p + p²)/p³ (a normal missed a Monte Carlo draw by 4% at μ = 9, p = 0.05; this by under 0.5%)."""
    k, mu = np.broadcast_arrays(np.asarray(k, dtype=np.float64), np.asarray(mu, dtype=np.float64))
    q = 1.0 - p
    probs = np.empty((POLYA_AEPPLI_EXACT + 1,) + mu.shape)
    probs[0] = np.exp(-mu)
    probs[1] = probs[0] * mu * p
    for n in range(2, POLYA_AEPPLI_EXACT + 1):
        probs[n] = ((mu * p + 2.0 * q * (n - 1)) * probs[n - 1] - q * q * (n - 2) * probs[n - 2]) / n
    cdf = np.minimum(np.cumsum(probs, axis=0), 1.0)
    exact = np.take_along_axis(cdf, np.clip(k, 0, POLYA_AEPPLI_EXACT).astype(int)[None], axis=0)[0]
    k1 = mu / p
    k2 = np.maximum(mu * (2.0 - p), 1e-300) / p ** 2
    k3 = np.maximum(mu * (6.0 - 6.0 * p + p * p), 1e-300) / p ** 3
    shape, scale = 4.0 * k2 ** 3 / k3 ** 2, k3 / (2.0 * k2)
    tail = gammainc(shape, np.maximum(k + 0.5 - (k1 - shape * scale), 0.0) / scale)
    return np.where(k < 0, 0.0, np.where(k <= POLYA_AEPPLI_EXACT, exact, tail))


@lru_cache(maxsize=None)
def _output_lengths(trace: str, output_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct output lengths of a bundled trace and how many requests have each (no trace: `output_tokens`)."""
    if not trace:
        return np.array([float(output_tokens)]), np.array([1.0])
    lengths, counts = np.unique(trace_lengths(trace)[1], return_counts=True)
    return lengths, counts.astype(np.float64)


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
