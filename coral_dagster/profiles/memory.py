"""GPU memory of a node holding some layers: engine reserve, weights, and the KV cache that fits in the rest.

The engine reserve follows vLLM's accounting: it uses `gpu_memory_utilization` of each GPU and, inside that,
keeps room for activations, CUDA graphs and NCCL buffers (`per_gpu_overhead_bytes`). Both are fitted to Helix's
measured KV-block counts (vLLM, LLaMA-1-30B, 7 node types; `fit_memory_params`). Every stage is also charged the
larger of the input embedding and the LM head, since the first and last stages hold them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from coral_dagster.catalog.gpus import GIB, NodeSpec, get_gpu
from coral_dagster.catalog.models import ModelSpec

#: A node holding layers must keep room for the KV cache of at least one sequence of this many tokens, otherwise
#: those layers "do not fit" (a node with weights but no KV room serves nothing).
MIN_KV_TOKENS = 4096
VLLM_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class MemoryParams:
    """Engine memory reserve: the usable share of each GPU and a fixed amount per GPU inside it."""

    gpu_memory_utilization: float = 0.9
    per_gpu_overhead_bytes: float = 2.5e9


def tp_unsupported_reason(model: ModelSpec, tp: int) -> str:
    """Why vLLM cannot shard `model` over `tp` GPUs ('' when it can): attention heads must split evenly, and KV
    heads must either split evenly or be replicated a whole number of times."""
    if model.n_heads % tp:
        return f"{model.alias} has {model.n_heads} attention heads, not divisible by {tp} GPUs"
    kv = model.n_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        return f"{model.alias} has {kv} KV heads, which {tp} GPUs can neither split nor replicate evenly"
    return ""


def kv_replication(model: ModelSpec, tp: int) -> float:
    """KV bytes stored per token relative to the model's own: >1 when a node has more GPUs than KV heads."""
    return tp * math.ceil(model.n_kv_heads / tp) / model.n_kv_heads


def reserve_bytes(model: ModelSpec, node: NodeSpec, params: MemoryParams) -> float:
    """Memory a stage cannot use for weights or KV cache."""
    per_gpu = node.gpu.mem_gib * GIB
    engine = node.config.count * ((1 - params.gpu_memory_utilization) * per_gpu + params.per_gpu_overhead_bytes)
    embeddings = model.vocab * model.hidden * model.weight_bytes_per_param
    return engine + embeddings


def free_bytes(model: ModelSpec, node: NodeSpec, layers: int, params: MemoryParams) -> float:
    """Bytes left for the KV cache after `layers` layers of weights and the reserve (negative: does not fit)."""
    return node.mem_bytes - reserve_bytes(model, node, params) - layers * model.weight_bytes_per_layer


def max_layers(model: ModelSpec, node: NodeSpec, params: MemoryParams) -> int:
    """Most layers whose weights fit with the reserve and room for `MIN_KV_TOKENS` of KV cache; 0 when vLLM cannot
    shard the model over the node's GPUs."""
    if tp_unsupported_reason(model, node.config.count):
        return 0
    kv_min = MIN_KV_TOKENS * model.kv_bytes_per_token_per_layer * kv_replication(model, node.config.count)
    room = node.mem_bytes - reserve_bytes(model, node, params)
    return max(0, min(model.n_layers, int(room // (model.weight_bytes_per_layer + kv_min))))


def kv_capacity_tokens(model: ModelSpec, node: NodeSpec, layers: int, params: MemoryParams) -> int:
    """KV-cache tokens (every layer counted in full) that fit after `layers` layers; 0 when they do not fit."""
    if layers < 1 or layers > max_layers(model, node, params):
        return 0
    per_token = layers * model.kv_bytes_per_token_per_layer * kv_replication(model, node.config.count)
    return int(free_bytes(model, node, layers, params) // per_token)


def fit_memory_params(helix_memory: dict, model: ModelSpec, gpu_names: dict[str, tuple[str, int]]) -> MemoryParams:
    """Fit the reserve to Helix's measured KV blocks: for each node and resident layer count k, vLLM had
    `16 * kv_blocks[k] * k` token-layers of KV room next to k layers of weights."""
    totals, usable = [], []
    for name, blocks in helix_memory["kv_blocks"].items():
        gpu, count = gpu_names[name]
        per_gpu = get_gpu(gpu).mem_gib * GIB
        for k, b in blocks.items():
            k = int(k)
            used = VLLM_BLOCK_TOKENS * b * k * model.kv_bytes_per_token_per_layer + k * model.weight_bytes_per_layer
            totals.append((count, per_gpu))
            usable.append(used)
    counts, per_gpu = np.array(totals, dtype=float).T
    usable_arr = np.array(usable)

    def residual(x: np.ndarray) -> np.ndarray:
        util, overhead_gb = x
        pred = counts * (util * per_gpu - overhead_gb * 1e9)
        return (pred - usable_arr) / usable_arr

    fit = least_squares(residual, x0=[0.9, 2.0], bounds=([0.5, 0.0], [1.0, 20.0]))
    return MemoryParams(round(float(fit.x[0]), 4), round(float(fit.x[1]) * 1e9, -6))
