"""Per-operator roofline of one transformer layer on one node, with per-GPU efficiencies fitted to measurements.

Each layer is split into operator groups whose time is the smooth maximum of compute time (FLOPs over the GPU's
dense TFLOP/s times a fitted efficiency) and memory time (bytes over HBM bandwidth times a fitted efficiency):

- dense linears: q, k, v, o projections, the dense MLP (or the MoE router and shared experts);
- routed experts: FLOPs of the active experts of every token; bytes of the distinct experts a batch touches,
  `E * (1 - (1 - k/E) ** tokens)`; experts stored below one byte per parameter (gpt-oss's MXFP4) run at a
  fitted fraction `lowbit_moe_eff` of the bf16 experts' efficiency (dequantisation);
- attention: causal prompt attention (FLOPs over token pairs, sliding-window layers capped at the window) or
  decode attention (reading the KV cache of `context_tokens` per sequence, GQA heads replicated when the node has
  more GPUs than KV heads);
- element-wise work (norms, residual adds, activation): memory only;
- tensor parallelism inside the node: two all-reduces of the hidden state per layer, ring time over the
  intra-node link with a fitted efficiency per GPU type, a latency per link kind and a per-link-kind growth
  `(tp / 2) ** scaling` (PCIe servers share host bridges, so their all-reduce slows with more GPUs);
- a fixed per-layer overhead per phase (kernel launches, framework).

Everything is vectorised over rows so that one call evaluates a whole table (the fit) or a whole curve (queries).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from coral_dagster.catalog.gpus import GpuType
from coral_dagster.profiles.shapes import LayerShape

#: Parameters fitted per GPU type, in this order.
GPU_PARAMS = ("compute_eff", "memory_eff", "attn_compute_eff", "attn_memory_eff", "prefill_overhead_ms",
              "decode_overhead_ms", "allreduce_eff")
#: Parameters shared by all GPUs.
GLOBAL_PARAMS = ("moe_compute_eff", "moe_memory_eff", "lowbit_moe_eff", "smooth_p", "elementwise_passes",
                 "vidur_time_factor")
#: Parameters per intra-node link kind.
LINK_PARAMS = ("allreduce_latency_ms", "allreduce_scaling")
LINKS = ("NVLink", "PCIe")

#: Feature columns `layer_features` returns (all per GPU of the node).
FEATURES = ("flops_dense", "bytes_dense", "flops_moe", "bytes_moe", "flops_attn", "bytes_attn", "bytes_elem_hidden",
            "bytes_elem_act", "allreduce_bytes", "n_allreduce", "tp", "decode", "lowbit_experts", "peak_flops_per_ms", "hbm_bytes_per_ms",
            "link_bytes_per_ms")


def prefill_pairs(seq_tokens: np.ndarray, window: int, sliding_fraction: float) -> np.ndarray:
    """Causal attention (query, key) pairs of one prompt of `seq_tokens`, averaged over full and sliding layers."""
    s = np.asarray(seq_tokens, dtype=float)
    full = s * (s + 1) / 2
    if not sliding_fraction:
        return full
    w = float(window)
    windowed = np.where(s <= w, full, w * (w + 1) / 2 + (s - w) * w)
    return (1 - sliding_fraction) * full + sliding_fraction * windowed


def effective_context(context_tokens: np.ndarray, window: int, sliding_fraction: float) -> np.ndarray:
    """Mean KV tokens a decode step reads per layer: sliding-window layers read at most the window."""
    c = np.asarray(context_tokens, dtype=float)
    if not sliding_fraction:
        return c
    return (1 - sliding_fraction) * c + sliding_fraction * np.minimum(c, window)


def layer_features(shape: LayerShape, gpu: GpuType, tp: int, phase: str, tokens: np.ndarray,
                   seq_tokens: np.ndarray | float = 1.0, context_tokens: np.ndarray | float = 0.0
                   ) -> dict[str, np.ndarray]:
    """FLOPs, bytes and message sizes one GPU of a `tp`-GPU node handles for one layer.

    Prefill: `tokens` prompt tokens in prompts of `seq_tokens` each. Decode: `tokens` sequences, one new token each,
    with `context_tokens` of KV cache each.
    """
    n = np.asarray(tokens, dtype=float)
    one = np.ones_like(n)
    h, d, t = shape.hidden, shape.head_dim, float(tp)
    wb, eb = shape.weight_bytes_per_param, shape.expert_bytes_per_param
    q_heads = shape.n_heads / t
    kv_heads = math.ceil(shape.n_kv_heads / tp)
    act = shape.activated_width
    f = {
        "flops_dense": 2 * n * shape.dense_params / t,
        "bytes_dense": shape.dense_params * wb / t * one
        + n * wb * (4 * h + (2 * q_heads + 2 * kv_heads) * d + 3 * act / t),
        "flops_moe": np.zeros_like(n), "bytes_moe": np.zeros_like(n),
        "bytes_elem_hidden": 2 * n * h * wb,
        "bytes_elem_act": 3 * n * act / t * wb,
    }
    if shape.is_moe:
        e, k = shape.n_experts, shape.n_active_experts
        distinct = e * (1 - (1 - k / e) ** n)
        f["flops_moe"] = 2 * n * k * shape.expert_params / t
        f["bytes_moe"] = distinct * shape.expert_params * eb / t + n * k * wb * (2 * h + 3 * shape.expert_intermediate / t)
    if phase == "prefill":
        seq = np.minimum(np.asarray(seq_tokens, dtype=float) * one, n)
        pairs = n / np.maximum(seq, 1) * prefill_pairs(seq, shape.sliding_window, shape.sliding_fraction)
        f["flops_attn"] = 4 * q_heads * d * pairs
        f["bytes_attn"] = n * (2 * q_heads + 2 * kv_heads) * d * wb
        f["decode"] = np.zeros_like(n)
    else:
        ctx = effective_context(np.asarray(context_tokens, dtype=float) * one, shape.sliding_window,
                                shape.sliding_fraction)
        f["flops_attn"] = 4 * q_heads * d * n * ctx
        f["bytes_attn"] = n * ctx * 2 * kv_heads * d * wb + n * 2 * q_heads * d * wb
        f["decode"] = np.ones_like(n)
    f["allreduce_bytes"] = 2 * (t - 1) / t * n * h * wb
    f["n_allreduce"] = (2.0 if tp > 1 else 0.0) * one
    f["lowbit_experts"] = (1.0 if shape.is_moe and eb < 1 else 0.0) * one
    f["tp"] = t * one
    f["peak_flops_per_ms"] = gpu.bf16_tflops * 1e9 * one
    f["hbm_bytes_per_ms"] = gpu.hbm_gb_s * 1e6 * one
    f["link_bytes_per_ms"] = gpu.intra_node_gb_s * 1e6 * one
    return f


def _smooth_max(a: np.ndarray, b: np.ndarray, p: float) -> np.ndarray:
    """A differentiable max: `(a**p + b**p) ** (1/p)`, scaled to avoid overflow."""
    m = np.maximum(np.maximum(a, b), 1e-30)
    return m * ((a / m) ** p + (b / m) ** p) ** (1.0 / p)


@dataclass(frozen=True)
class RowParams:
    """Parameter values broadcast to rows: arrays (per row) or scalars."""

    compute_eff: np.ndarray | float
    memory_eff: np.ndarray | float
    attn_compute_eff: np.ndarray | float
    attn_memory_eff: np.ndarray | float
    prefill_overhead_ms: np.ndarray | float
    decode_overhead_ms: np.ndarray | float
    moe_compute_eff: float
    moe_memory_eff: float
    lowbit_moe_eff: float
    smooth_p: float
    elementwise_passes: float
    vidur_time_factor: float
    allreduce_eff: np.ndarray | float
    allreduce_latency_ms: np.ndarray | float
    allreduce_scaling: np.ndarray | float


def layer_ms(f: dict[str, np.ndarray], p: RowParams, full_layer: np.ndarray | bool = True) -> np.ndarray:
    """Per-layer milliseconds. `full_layer` False keeps only dense linears and element-wise work, scaled by
    `vidur_time_factor`: the operators Vidur's `mlp.csv` tables time, on its older software stack."""
    peak, hbm = f["peak_flops_per_ms"], f["hbm_bytes_per_ms"]
    dense = _smooth_max(f["flops_dense"] / (peak * p.compute_eff), f["bytes_dense"] / (hbm * p.memory_eff),
                        p.smooth_p)
    elem = (p.elementwise_passes * f["bytes_elem_hidden"] + f["bytes_elem_act"]) / (hbm * p.memory_eff)
    lowbit = np.where(f["lowbit_experts"] > 0, p.lowbit_moe_eff, 1.0)
    moe = _smooth_max(f["flops_moe"] / (peak * p.compute_eff * p.moe_compute_eff * lowbit),
                      f["bytes_moe"] / (hbm * p.memory_eff * p.moe_memory_eff * lowbit), p.smooth_p)
    attn = _smooth_max(f["flops_attn"] / (peak * p.attn_compute_eff), f["bytes_attn"] / (hbm * p.attn_memory_eff),
                       p.smooth_p)
    comm = f["n_allreduce"] * (p.allreduce_latency_ms + f["allreduce_bytes"] * (f["tp"] / 2) ** p.allreduce_scaling
                               / (f["link_bytes_per_ms"] * p.allreduce_eff))
    overhead = np.where(f["decode"] > 0, p.decode_overhead_ms, p.prefill_overhead_ms)
    rest = moe + attn + comm + overhead
    return np.where(full_layer, dense + elem + rest, (dense + elem) * p.vidur_time_factor)


def attention_ms(f: dict[str, np.ndarray], p: RowParams) -> np.ndarray:
    """The attention operator group alone (used to move a measured curve to another context length)."""
    return _smooth_max(f["flops_attn"] / (f["peak_flops_per_ms"] * p.attn_compute_eff),
                       f["bytes_attn"] / (f["hbm_bytes_per_ms"] * p.attn_memory_eff), p.smooth_p)
