"""The performance model the planner queries: per-layer latency, memory, and T̂ (best tokens/s within a budget).

Latency of (model, node, phase) comes from the most trusted source that has it:

1. `measured:helix` — Helix's vLLM per-layer tables (LLaMA-1-30B on A100-40GB, L4, L4:2, T4, T4:2, T4:4, V100);
2. `measured:aiconfigurator` — per-layer times composed by aiconfigurator from NVIDIA's measured kernels (H100,
   H200, A100-80GB, L40S; TP 1-8);
3. `measured:vidur` — Vidur's measured non-attention operators (A100-80GB, H100, A40), divided by the fitted
   `vidur_time_factor`, plus attention, all-reduce and overhead from the calibrated roofline; ranked below
   aiconfigurator because Vidur lacks attention and its kernels are slower than today's (see `fit.py`);
4. `model:roofline-calibrated` — the roofline of `roofline.py` with efficiencies fitted to all of the above.

A measured curve is used inside its measured batch range; outside it, the roofline scaled to meet the nearest
measured point. A curve measured at another prompt length or context is moved to the one asked for by the
roofline's ratio between the two. Curves are sampled on a fixed geometric grid of batch sizes (plus the measured
batches) and interpolated linearly, so a query is a bisection over ~100 floats.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pandas as pd

from coral_dagster.catalog.gpus import NodeSpec, node_spec
from coral_dagster.catalog.models import ModelSpec, get_model
from coral_dagster.catalog.nodes import NodeConfig
from coral_dagster.errors import CoralError
from coral_dagster.profiles import memory as mem
from coral_dagster.profiles.curves import Curve
from coral_dagster.profiles.fit import RooflineFit, load_fit
from coral_dagster.profiles.measured import load_measured
from coral_dagster.profiles.roofline import layer_features, layer_ms
from coral_dagster.profiles.shapes import LayerShape
from coral_dagster.vocab import Bound, DEMAND_PHASES, DemandPhase as Phase

#: Prompt length prefill batches are made of, unless a query says otherwise (aiconfigurator tables use the same).
PREFILL_SEQ_TOKENS = 1024
PREFILL_GRID = np.unique(np.round(np.geomspace(1, 2**24, 121)).astype(int))
DECODE_GRID = np.unique(np.round(np.geomspace(1, 2**17, 103)).astype(int))
SOURCE_RANK = ("measured:helix", "measured:aiconfigurator", "measured:vidur")


@dataclass(frozen=True)
class ThroughputPoint:
    """T̂ of one node holding some layers: tokens/s, the batch that reaches it, the stage time, and what bound it.

    bound: `memory` — KV capacity capped the batch (or the weights do not fit: tokens_per_s 0); `compute` — the
    latency budget capped it and compute dominates the stage time; `network` — the budget capped it and the
    activation transfer dominates; `slo` — not even a batch of one meets the budget (tokens_per_s 0).
    """

    tokens_per_s: float
    batch: int
    stage_ms: float
    bound: Bound


def _node(node: NodeConfig | NodeSpec | str) -> NodeSpec:
    if isinstance(node, NodeSpec):
        return node
    return node_spec(node)


def _model(model: ModelSpec | str) -> ModelSpec:
    return model if isinstance(model, ModelSpec) else get_model(model)


class PerfModel:
    """Per-layer latency and memory of every (model, node) pair; see the module docstring for the sources."""

    def __init__(self, fit: RooflineFit, measured: pd.DataFrame | None = None, *,
                 prefill_seq_tokens: int = PREFILL_SEQ_TOKENS) -> None:
        self.fit = fit
        self.prefill_seq_tokens = prefill_seq_tokens
        self._measured: dict[tuple, pd.DataFrame] = {}
        if measured is not None and not measured.empty:
            for key, t in measured.groupby(["source", "model", "gpu", "tp", "phase"], sort=True):
                self._measured[key] = t.sort_values(["context_tokens", "tokens"], kind="stable")
        self._curves: dict[tuple, Curve] = {}
        self._t_hat_cached = lru_cache(maxsize=1 << 18)(self._t_hat)

    # ---- latency ----

    def prefill_ms_per_layer(self, model: ModelSpec | str, node: NodeConfig | str, tokens: int,
                             seq_tokens: int | None = None) -> float:
        """Milliseconds one layer takes for a prefill batch of `tokens` prompt tokens (prompts of `seq_tokens`,
        default `prefill_seq_tokens`)."""
        if tokens < 1:
            raise CoralError(f"prefill batch of {tokens} tokens.", "ask for at least 1 token.")
        return self.curve(model, node, "prefill", seq_tokens or self.prefill_seq_tokens)(tokens)

    def decode_ms_per_layer(self, model: ModelSpec | str, node: NodeConfig | str, batch: int,
                            context_tokens: float) -> float:
        """Milliseconds one layer takes for one decode iteration of `batch` sequences of `context_tokens` each."""
        if batch < 1:
            raise CoralError(f"decode batch of {batch} sequences.", "ask for at least 1 sequence.")
        return self.curve(model, node, "decode", max(int(context_tokens), 1))(batch)

    def source(self, model: ModelSpec | str, node: NodeConfig | str, phase: Phase) -> str:
        """Where the latency of (model, node, phase) comes from."""
        ctx = self.prefill_seq_tokens if phase == "prefill" else 1024
        return self.curve(model, node, phase, ctx).source

    def curve(self, model: ModelSpec | str, node: NodeConfig | NodeSpec | str, phase: Phase, shape_tokens: int
              ) -> Curve:
        """The per-layer latency curve over batch for a prompt length (prefill) or context length (decode)."""
        m, n = _model(model), _node(node)
        key = (m.alias, str(n.config), phase, int(shape_tokens))
        curve = self._curves.get(key)
        if curve is None:
            if phase not in DEMAND_PHASES:
                raise CoralError(f"unknown phase {phase!r}.", "use prefill or decode.")
            curve = self._curves[key] = self._build_curve(m, n, phase, int(shape_tokens))
        return curve

    def _roofline(self, shape: LayerShape, node: NodeSpec, phase: str, xs: np.ndarray,
                  shape_tokens: int | np.ndarray, full: bool = True) -> np.ndarray:
        """Roofline ms per layer at batches `xs`, prompt (prefill) or context (decode) lengths `shape_tokens`."""
        seq, ctx = (shape_tokens, 0) if phase == "prefill" else (1, shape_tokens)
        f = layer_features(shape, node.gpu, node.config.count, phase, xs, seq, ctx)
        return layer_ms(f, self.fit.scalar_params(node.gpu), full)

    def _build_curve(self, model: ModelSpec, node: NodeSpec, phase: str, shape_tokens: int) -> Curve:
        shape = LayerShape.of(model)
        grid = (PREFILL_GRID if phase == "prefill" else DECODE_GRID).astype(float)
        roof = self._roofline(shape, node, phase, grid, shape_tokens)
        for source in SOURCE_RANK:
            pts = self._measured_points(source, model, shape, node, phase, shape_tokens)
            if pts is None:
                continue
            xs, ys = pts
            grid = np.union1d(grid, xs)
            roof = self._roofline(shape, node, phase, grid, shape_tokens)
            inside = (grid >= xs[0]) & (grid <= xs[-1])
            out = np.empty_like(grid)
            out[inside] = np.interp(grid[inside], xs, ys)
            low, high = grid < xs[0], grid > xs[-1]
            out[low] = roof[low] * ys[0] / self._roofline(shape, node, phase, xs[:1], shape_tokens)[0]
            out[high] = roof[high] * ys[-1] / self._roofline(shape, node, phase, xs[-1:], shape_tokens)[0]
            return Curve.build(grid, out, source)
        return Curve.build(grid, roof, "model:roofline-calibrated")

    def _measured_points(self, source: str, model: ModelSpec, shape: LayerShape, node: NodeSpec, phase: str,
                         shape_tokens: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Measured (batch, ms) of this pair moved to `shape_tokens`, or None when the source lacks it."""
        gpu, tp = node.gpu.name, node.config.count
        if source == "measured:vidur":
            return self._vidur_points(shape, node, phase, shape_tokens)
        t = self._measured.get((source, model.alias, gpu, tp, phase))
        if t is None:
            return None
        if phase == "decode":
            t = self._at_context(t, shape_tokens)
            xs = t["tokens"].to_numpy(float)
            ys = t["ms_per_layer"].to_numpy(float)
            measured_ctx = t["context_tokens"].to_numpy(float)
            if not np.allclose(measured_ctx, shape_tokens):
                ys = ys * self._roofline(shape, node, phase, xs, shape_tokens) / self._roofline(
                    shape, node, phase, xs, measured_ctx)
            return xs, ys
        xs = t["tokens"].to_numpy(float)
        ys = t["ms_per_layer"].to_numpy(float)
        seq = t["seq_tokens"].to_numpy(float)
        want = np.minimum(xs, shape_tokens)
        if not np.allclose(seq, want):
            ys = ys * self._roofline(shape, node, phase, xs, shape_tokens) / self._roofline(
                shape, node, phase, xs, seq)
        return xs, ys

    @staticmethod
    def _at_context(t: pd.DataFrame, context_tokens: int) -> pd.DataFrame:
        """Decode rows at `context_tokens`: interpolated between the two measured contexts around it, else the
        nearest measured context (then moved by the roofline ratio)."""
        contexts = np.unique(t["context_tokens"].to_numpy())
        if context_tokens in contexts or len(contexts) == 1:
            return t[t["context_tokens"] == (context_tokens if context_tokens in contexts else contexts[0])]
        if context_tokens < contexts[0] or context_tokens > contexts[-1]:
            nearest = contexts[0] if context_tokens < contexts[0] else contexts[-1]
            return t[t["context_tokens"] == nearest]
        hi = contexts[np.searchsorted(contexts, context_tokens)]
        lo = contexts[np.searchsorted(contexts, context_tokens) - 1]
        a = t[t["context_tokens"] == lo].set_index("tokens")["ms_per_layer"]
        b = t[t["context_tokens"] == hi].set_index("tokens")["ms_per_layer"]
        w = (context_tokens - lo) / (hi - lo)
        both = a.index.intersection(b.index)
        mixed = (1 - w) * a.loc[both] + w * b.loc[both]
        return pd.DataFrame({"tokens": both, "ms_per_layer": mixed.to_numpy(), "context_tokens": context_tokens})

    def _vidur_points(self, shape: LayerShape, node: NodeSpec, phase: str, shape_tokens: int):
        """Vidur's non-attention operators for a model of the same layer shape (dense models only)."""
        if shape.is_moe or shape.sliding_fraction:
            return None
        for (source, name, gpu, tp, _), t in self._measured.items():
            if source != "measured:vidur" or gpu != node.gpu.name or tp != node.config.count:
                continue
            r = t.iloc[0]
            if (int(r.hidden), int(r.n_heads), int(r.n_kv_heads), int(r.intermediate)) != (
                    shape.hidden, shape.n_heads, shape.n_kv_heads, shape.intermediate):
                continue
            xs = t["tokens"].to_numpy(float)
            non_attention = t["ms_per_layer"].to_numpy(float) / self.fit.global_params["vidur_time_factor"]
            rest = (self._roofline(shape, node, phase, xs, shape_tokens)
                    - self._roofline(shape, node, phase, xs, shape_tokens, full=False)
                    / self.fit.global_params["vidur_time_factor"])
            return xs, non_attention + rest
        return None

    # ---- memory ----

    def engine_reserve_bytes(self, model: ModelSpec | str, node: NodeConfig | NodeSpec | str) -> float:
        """Memory of a node no layer weights or KV cache may use (engine reserve plus embeddings)."""
        return mem.reserve_bytes(_model(model), _node(node), self.fit.memory)

    def max_layers(self, model: ModelSpec | str, node: NodeConfig | NodeSpec | str) -> int:
        """Most layers whose weights fit beside the engine reserve and `MIN_KV_TOKENS` of KV cache (0 when vLLM
        cannot shard the model over the node's GPUs)."""
        return _max_layers(_model(model), _node(node), self.fit.memory)

    def kv_capacity_tokens(self, model: ModelSpec | str, node: NodeConfig | str, layers: int) -> int:
        """KV-cache tokens that fit after `layers` layers of weights and the reserve; 0 when the weights do not."""
        return _kv_capacity(_model(model), _node(node), int(layers), self.fit.memory)

    # ---- T̂ ----

    def t_hat(self, model: ModelSpec | str, node: NodeConfig | str, phase: Phase, layers: int, budget_ms: float,
              context_tokens: int = 0, send_gbps: float | None = None, *,
              resident_batches: int = 1) -> ThroughputPoint:
        """T̂: the most tokens/s `node` reaches holding `layers` layers within a per-stage budget of `budget_ms`.

        Prefill: batches of B prompt tokens (prompts of `prefill_seq_tokens`); decode: b sequences at
        `context_tokens`, one new token each. A batch is feasible when `layers * ms_per_layer(batch)` plus, with
        `send_gbps`, the transfer of its activations to the next stage fits the budget, and its KV cache fits the
        memory left after the weights. Among feasible batches the one with the highest throughput is taken (the
        largest feasible one whenever the per-token cost falls with batch size, which it does on every shipped
        curve but for measurement jitter). tokens_per_s is 0 exactly when the weights do not fit (`memory`) or no
        batch meets the budget (`slo`). Non-increasing in `layers`, non-decreasing in `budget_ms`; cached.

        `resident_batches`: micro-batches whose KV cache the node holds at once; a pipeline of S stages keeps S
        in flight, so its nodes need room for S batches (1, the default, checks one batch).
        """
        if resident_batches < 1:
            raise CoralError(f"T̂ asked for {resident_batches} resident micro-batches.", "ask for 1 or more.")
        return self._t_hat_cached(model, node, phase, int(layers), float(budget_ms), int(context_tokens),
                                  None if send_gbps is None else float(send_gbps), int(resident_batches))

    def _t_hat(self, model: ModelSpec | str, node: NodeConfig | str, phase: Phase, layers: int,
               budget_ms: float, context_tokens: int, send_gbps: float | None,
               resident_batches: int = 1) -> ThroughputPoint:
        m, n = _model(model), _node(node)
        if layers < 1:
            raise CoralError(f"T̂ asked for {layers} layers.", "ask for 1 or more layers.")
        if phase not in DEMAND_PHASES:
            raise CoralError(f"unknown phase {phase!r}.", "use prefill or decode.")
        if layers > _max_layers(m, n, self.fit.memory):
            return ThroughputPoint(0.0, 0, 0.0, "memory")
        free = mem.free_bytes(m, n, layers, self.fit.memory)
        per_unit_ms = 0.0 if not send_gbps else m.activation_bytes_per_token * 8 / (send_gbps * 1e9) * 1e3
        rep = mem.kv_replication(m, n.config.count)
        if phase == "prefill":
            seq = self.prefill_seq_tokens
            curve = self.curve(m, n, "prefill", seq)
            kv_per_unit = layers * m.kv_bytes_per_layer(seq) / seq * rep
        else:
            ctx = max(int(context_tokens), 1)
            curve = self.curve(m, n, "decode", ctx)
            kv_per_unit = layers * m.kv_bytes_per_layer(ctx) * rep
        capacity = int(free // (kv_per_unit * resident_batches))
        if capacity < 1:
            return ThroughputPoint(0.0, 0, 0.0, "memory")
        within = curve.largest_within(layers, per_unit_ms, budget_ms)
        if within < 1:
            return ThroughputPoint(0.0, 0, 0.0, "slo")
        upto = min(within, capacity)
        batch = curve.best_batch(upto)
        compute_ms = layers * curve(batch)
        stage_ms = compute_ms + per_unit_ms * batch
        if batch == capacity and capacity < within:
            bound: Bound = "memory"
        elif per_unit_ms * batch > compute_ms:
            bound = "network"
        else:
            bound = "compute"
        return ThroughputPoint(batch * 1000.0 / stage_ms, batch, stage_ms, bound)


@lru_cache(maxsize=1 << 14)
def _max_layers(model: ModelSpec, node: NodeSpec, params: mem.MemoryParams) -> int:
    return mem.max_layers(model, node, params)


@lru_cache(maxsize=1 << 16)
def _kv_capacity(model: ModelSpec, node: NodeSpec, layers: int, params: mem.MemoryParams) -> int:
    return mem.kv_capacity_tokens(model, node, layers, params)


@lru_cache(maxsize=1)
def default_perf_model() -> PerfModel:
    """The model over the shipped measured tables and fit, built once per process."""
    return PerfModel(load_fit(), load_measured())
