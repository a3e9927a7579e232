"""The profiling job: time a few random-weight decoder layers of a catalog model with torch on the local device.

The layers follow the catalog architecture (RMSNorm, GQA attention with a KV cache, sliding-window layers where
the model has them, SwiGLU MLP or a routed top-k MoE). On CPU the layer is shrunk by `hidden_scale` (hidden,
heads, MLP and expert widths; the head size stays) so a run takes seconds; the table says so. Per-layer time is
the time of the stack divided by its layers (the stack has no embedding or LM head). `engine="vllm"` instead times
vLLM itself on the GPU (dummy weights, the layer count overridden), taking the difference between two layer
counts so embedding, LM head and sampling cancel out.
"""

from __future__ import annotations

import math
import platform
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone

import pandas as pd

from coral_dagster.catalog.gpus import node_spec
from coral_dagster.catalog.models import ModelSpec, get_model
from coral_dagster.errors import CoralError
from coral_dagster.profiles import memory as mem
from coral_dagster.profiles.table import COLUMNS

#: Parameters per layer the CPU default shrinks a layer to (about 0.1 s per 512-token prefill on two cores).
CPU_LAYER_PARAMS = 6e6


@dataclass(frozen=True)
class RunConfig:
    """What one profiling run measures."""

    model: str
    node: str
    layers: int = 2
    device: str = "cpu"
    engine: str = "torch"
    hidden_scale: float | None = None
    prefill_tokens: tuple[int, ...] = (32, 128, 512)
    decode_batch: tuple[int, ...] = (1, 4, 16)
    context_tokens: int = 256
    repeats: int = 3
    seed: int = 0

    @classmethod
    def for_device(cls, model: str, node: str, device: str, **overrides) -> "RunConfig":
        """Defaults sized for the device: small batches on CPU, serving-sized ones on CUDA."""
        base = cls(model, node, device=device)
        if device == "cuda":
            base = replace(base, prefill_tokens=(256, 1024, 4096, 16384), decode_batch=(1, 8, 32, 128, 512),
                           context_tokens=1024, hidden_scale=1.0)
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def auto_hidden_scale(model: ModelSpec, device: str) -> float:
    """1 on CUDA; on CPU the factor that brings a layer (experts capped as in `scaled_dims`) to CPU_LAYER_PARAMS."""
    if device != "cpu":
        return 1.0
    experts = min(model.n_experts, 4 * model.n_active_experts) if model.is_moe else 0
    width = model.expert_intermediate * (experts + model.n_shared_experts) if model.is_moe else model.intermediate
    params = 4 * model.hidden * model.n_heads * model.head_dim + 3 * model.hidden * width
    return min(1.0, math.sqrt(CPU_LAYER_PARAMS / params))


def scaled_dims(model: ModelSpec, scale: float) -> dict:
    """Layer dimensions at `scale` (head size kept, GQA ratio kept; at scale < 1 experts capped at 4x active)."""
    def round64(x: float) -> int:
        return max(64, int(round(x / 64)) * 64)

    group = model.n_heads // model.n_kv_heads
    kv = max(1, round(model.n_kv_heads * scale))
    experts = model.n_experts if scale >= 1 or not model.is_moe else min(model.n_experts,
                                                                         4 * model.n_active_experts)
    return {
        "hidden": model.hidden if scale >= 1 else round64(model.hidden * scale),
        "n_heads": model.n_heads if scale >= 1 else kv * group,
        "n_kv_heads": model.n_kv_heads if scale >= 1 else kv,
        "head_dim": model.head_dim,
        "intermediate": model.intermediate if scale >= 1 else round64(model.intermediate * scale),
        "n_experts": experts, "n_active_experts": model.n_active_experts,
        "expert_intermediate": 0 if not model.is_moe else (model.expert_intermediate if scale >= 1
                                                             else round64(model.expert_intermediate * scale)),
        "n_shared_experts": model.n_shared_experts, "sliding_window": model.sliding_window,
        "sliding": model.n_sliding_layers > 0,
    }


def _build_layers(dims: dict, layers: int, device: str, dtype):
    """A stack of random-weight decoder layers with the given dimensions."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    h, hq, hkv, d = dims["hidden"], dims["n_heads"], dims["n_kv_heads"], dims["head_dim"]

    class Layer(nn.Module):
        def __init__(self, sliding: bool) -> None:
            super().__init__()
            self.window = dims["sliding_window"] if sliding else 0
            self.norm1, self.norm2 = nn.RMSNorm(h), nn.RMSNorm(h)
            self.qkv = nn.Linear(h, (hq + 2 * hkv) * d, bias=False)
            self.o = nn.Linear(hq * d, h, bias=False)
            if dims["n_experts"]:
                e, ie = dims["n_experts"], dims["expert_intermediate"]
                self.router = nn.Linear(h, e, bias=False)
                self.w_in = nn.Parameter(torch.randn(e, h, 2 * ie) * h ** -0.5)
                self.w_out = nn.Parameter(torch.randn(e, ie, h) * ie ** -0.5)
            else:
                self.up = nn.Linear(h, 2 * dims["intermediate"], bias=False)
                self.down = nn.Linear(dims["intermediate"], h, bias=False)

        def mlp(self, x):
            if not dims["n_experts"]:
                gate, up = self.up(x).chunk(2, dim=-1)
                return self.down(F.silu(gate) * up)
            flat = x.reshape(-1, h)
            weights, chosen = torch.topk(torch.softmax(self.router(flat), dim=-1), dims["n_active_experts"])
            out = torch.zeros_like(flat)
            for expert in torch.unique(chosen).tolist():
                rows, slot = torch.nonzero(chosen == expert, as_tuple=True)
                gate, up = (flat[rows] @ self.w_in[expert]).chunk(2, dim=-1)
                out.index_add_(0, rows, (F.silu(gate) * up) @ self.w_out[expert] * weights[rows, slot, None])
            return out.reshape(x.shape)

        def forward(self, x, cache_k=None, cache_v=None):
            b, s, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).split([hq * d, hkv * d, hkv * d], dim=-1)
            q = q.view(b, s, hq, d).transpose(1, 2)
            k = k.view(b, s, hkv, d).transpose(1, 2)
            v = v.view(b, s, hkv, d).transpose(1, 2)
            if cache_k is None:
                mask = None
                if self.window and s > self.window:
                    i = torch.arange(s, device=x.device)
                    mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
                attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                      enable_gqa=hq != hkv)
            else:
                ctx = cache_k.shape[2] if not self.window else min(cache_k.shape[2], self.window)
                k = torch.cat([cache_k[:, :, -ctx:], k], dim=2)
                v = torch.cat([cache_v[:, :, -ctx:], v], dim=2)
                attn = F.scaled_dot_product_attention(q, k, v, enable_gqa=hq != hkv)
            x = x + self.o(attn.transpose(1, 2).reshape(b, s, hq * d))
            return x + self.mlp(self.norm2(x))

    stack = nn.ModuleList([Layer(dims["sliding"] and i % 2 == 0) for i in range(layers)])
    return stack.to(device=device, dtype=dtype).eval()


def _timed(fn, device: str, repeats: int) -> float:
    """Median wall milliseconds of `fn` after one warm-up call."""
    import torch

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def _torch_measure(cfg: RunConfig, model: ModelSpec, scale: float) -> list[dict]:
    import torch

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise CoralError("--device cuda asked for, but torch sees no CUDA device.", "run with --device cpu.")
    torch.manual_seed(cfg.seed)
    dtype = torch.bfloat16 if cfg.device == "cuda" else torch.float32
    dims = scaled_dims(model, scale)
    stack = _build_layers(dims, cfg.layers, cfg.device, dtype)
    rows = []
    with torch.inference_mode():
        for tokens in cfg.prefill_tokens:
            x = torch.randn(1, tokens, dims["hidden"], device=cfg.device, dtype=dtype)

            def prefill(x=x):
                y = x
                for layer in stack:
                    y = layer(y)
                return y

            ms = _timed(prefill, cfg.device, cfg.repeats) / cfg.layers
            rows.append({"phase": "prefill", "tokens": tokens, "seq_tokens": tokens, "context_tokens": 0,
                         "ms_per_layer": ms})
        for batch in cfg.decode_batch:
            shape = (batch, dims["n_kv_heads"], cfg.context_tokens, dims["head_dim"])
            caches = [(torch.randn(shape, device=cfg.device, dtype=dtype), torch.randn(shape, device=cfg.device,
                                                                                         dtype=dtype))
                      for _ in range(cfg.layers)]
            x = torch.randn(batch, 1, dims["hidden"], device=cfg.device, dtype=dtype)

            def decode(x=x, caches=caches):
                y = x
                for layer, (k, v) in zip(stack, caches):
                    y = layer(y, k, v)
                return y

            ms = _timed(decode, cfg.device, cfg.repeats) / cfg.layers
            rows.append({"phase": "decode", "tokens": batch, "seq_tokens": 1, "context_tokens": cfg.context_tokens,
                         "ms_per_layer": ms})
    return rows


def _vllm_measure(cfg: RunConfig, model: ModelSpec) -> list[dict]:
    """Time vLLM with `layers` and `2 * layers` dummy-weight layers; per-layer time is the difference over layers.
    Needs a CUDA node with vLLM installed (the SkyPilot task installs it)."""
    try:
        from vllm import LLM, SamplingParams
    except ImportError as exc:
        raise CoralError("--engine vllm needs vLLM, which is not installed here.",
                         "pip install 'coral-dagster[gpu]' on a GPU node, or use --engine torch.") from exc
    import gc

    import torch

    tp = node_spec(cfg.node).config.count
    totals: dict[int, dict[tuple, float]] = {}
    for layers in (cfg.layers, 2 * cfg.layers):
        llm = LLM(model=model.hf_id, hf_overrides={"num_hidden_layers": layers}, load_format="dummy",
                  tensor_parallel_size=tp, seed=cfg.seed, max_model_len=max(cfg.prefill_tokens + (
                      cfg.context_tokens + 16,)), enable_prefix_caching=False)
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        many = SamplingParams(max_tokens=9, ignore_eos=True)

        def run(n: int, length: int, params) -> float:
            prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(length)]} for i in range(n)]
            return _timed(lambda: llm.generate(prompts, params, use_tqdm=False), "cuda", cfg.repeats)

        t = totals[layers] = {}
        for tokens in cfg.prefill_tokens:
            t[("prefill", tokens)] = run(1, tokens, one)
        for batch in cfg.decode_batch:
            t[("decode", batch)] = (run(batch, cfg.context_tokens, many) - run(batch, cfg.context_tokens, one)) / 8
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    lo, hi = totals[cfg.layers], totals[2 * cfg.layers]
    return [{"phase": phase, "tokens": n, "seq_tokens": n if phase == "prefill" else 1,
             "context_tokens": 0 if phase == "prefill" else cfg.context_tokens,
             "ms_per_layer": max((hi[(phase, n)] - lo[(phase, n)]) / cfg.layers, 1e-6)} for phase, n in lo]


def run_profile(cfg: RunConfig) -> tuple[pd.DataFrame, dict]:
    """Measure and return (table in the profile-table shape, run notes)."""
    model = get_model(cfg.model)
    node = node_spec(cfg.node)
    if cfg.layers < 1:
        raise CoralError(f"--layers {cfg.layers}.", "profile at least 1 layer.")
    if cfg.engine not in ("torch", "vllm"):
        raise CoralError(f"unknown engine {cfg.engine!r}.", "use torch or vllm.")
    if cfg.engine == "vllm" and cfg.device != "cuda":
        raise CoralError("--engine vllm runs on CUDA only.", "add --device cuda, or use --engine torch.")
    scale = cfg.hidden_scale if cfg.hidden_scale is not None else auto_hidden_scale(model, cfg.device)
    started = time.perf_counter()
    if cfg.engine == "vllm":
        rows, scale = _vllm_measure(cfg, model), 1.0
    else:
        rows = _torch_measure(cfg, model, scale)
    source = f"measured:{'vllm' if cfg.engine == 'vllm' else 'torch'}-{cfg.device}"
    params = mem.MemoryParams()
    common = {
        "model": model.alias, "node": str(node.config), "gpu": node.gpu.name, "gpus": node.config.count,
        "weight_bytes_per_layer": model.weight_bytes_per_layer,
        "kv_bytes_per_token_per_layer": model.kv_bytes_per_token_per_layer
        * mem.kv_replication(model, node.config.count),
        "engine_reserve_bytes": mem.reserve_bytes(model, node, params),
        "max_layers": mem.max_layers(model, node, params), "source": source,
    }
    df = pd.DataFrame([{**common, **r} for r in rows])[COLUMNS]
    df["hidden_scale"] = scale
    import torch

    notes = {
        "config": asdict(cfg), "hidden_scale": scale, "dims": scaled_dims(model, scale),
        "torch": torch.__version__, "host": platform.node(), "processor": platform.processor() or platform.machine(),
        "measured_at": datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
        "wall_s": round(time.perf_counter() - started, 2),
        "note": ("the table is filed under the node asked for; the times are of this host's "
                 f"{cfg.device.upper()}" + (f", on a layer shrunk by hidden_scale={scale:.3g} (hidden, heads and "
                                            "MLP widths; experts capped at 4x active)" if scale < 1 else "")
                 + ("; tensor parallelism is not emulated" if cfg.engine == "torch" and node.config.count > 1
                    else "")),
    }
    return df, notes
