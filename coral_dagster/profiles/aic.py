"""Per-layer tables from NVIDIA's measured kernel database, through the `aiconfigurator-core` library.

aiconfigurator composes a model's step time from kernels it measured on each GPU (GEMM, attention, MoE, NCCL and
custom all-reduce). We ask it, per (model, GPU, TP degree), for a prefill step and a decode step on a grid of
batches and context lengths, sum the per-layer operators (everything but embedding, LM head and pipeline p2p) and
divide by the layer count. The result ships as `data/profiles/aiconfigurator_layers.csv`; the library is needed
only to regenerate it (`coral profile aic-tables`).
"""

from __future__ import annotations

import json
import logging
import tempfile
from importlib import metadata, resources
from pathlib import Path

import pandas as pd

from coral_dagster import paths
from coral_dagster.paths import AIC_FILE
from coral_dagster.catalog.models import ModelSpec, model_catalog
from coral_dagster.profiles.memory import tp_unsupported_reason

#: Our GPU type -> aiconfigurator system (SXM boards; `A100-80GB` is its `a100_sxm`).
AIC_SYSTEMS = {"H100": "h100_sxm", "H200": "h200_sxm", "A100-80GB": "a100_sxm", "L40S": "l40s"}
AIC_BACKEND = "vllm"
AIC_TP = (1, 2, 4, 8)
#: Prompt length of prefill batches: a batch of T tokens is one prompt when T <= this, else T / this prompts.
AIC_SEQ_TOKENS = 1024
AIC_PREFILL_TOKENS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
AIC_DECODE_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
AIC_CONTEXT_TOKENS = (128, 512, 2048, 8192)
log = logging.getLogger(__name__)
_SKIP = ("embedding", "logits", "p2p")


def _category(op: str) -> str:
    if "attention" in op:
        return "attn_ms"
    if op.endswith(("_ar_1", "_ar_2")) or "dispatch" in op:
        return "comm_ms"
    if "moe" in op:
        return "moe_ms"
    if "gemm" in op:
        return "gemm_ms"
    return "other_ms"


def _llama_config(model: ModelSpec) -> dict:
    """A Llama-layout `config.json` for dense models whose HF config the wheel does not bundle (their layers are
    RMSNorm + GQA attention + SwiGLU MLP, which is what the Llama family models)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": model.hidden,
        "intermediate_size": model.intermediate, "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads, "head_dim": model.head_dim, "num_hidden_layers": model.n_layers,
        "vocab_size": model.vocab, "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
        "tie_word_embeddings": model.tie_embeddings, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    }


def aic_model_path(model: ModelSpec, workdir: Path) -> tuple[str, str]:
    """(path aiconfigurator loads, how we got it): the wheel's bundled HF config, or a Llama-layout config written
    from the catalog."""
    bundled = resources.files("aiconfigurator_core") / "model_configs" / f"{model.hf_id.replace('/', '--')}_config.json"
    if bundled.is_file():
        return model.hf_id, "bundled-config"
    if model.is_moe:
        raise ValueError(f"{model.alias}: no bundled aiconfigurator config for an MoE model")
    d = workdir / model.alias
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(_llama_config(model)))
    return str(d), "llama-layout-config"


def _per_layer(ops: list, n_layers: int) -> dict[str, float]:
    out = {"gemm_ms": 0.0, "moe_ms": 0.0, "attn_ms": 0.0, "comm_ms": 0.0, "other_ms": 0.0}
    for name, ms, *_ in ops:
        if not any(s in name for s in _SKIP):
            out[_category(name)] += ms / n_layers
    out["ms_per_layer"] = sum(out.values())
    return out


def build_aic_tables(models: list[ModelSpec] | None = None, gpus: tuple[str, ...] = tuple(AIC_SYSTEMS),
                     out_dir: Path | None = None, progress: bool = True) -> pd.DataFrame:
    """Query aiconfigurator for every (model, GPU, TP) and write `aiconfigurator_layers.csv`."""
    from aiconfigurator_core.sdk.engine import EngineHandle
    from aiconfigurator_core.sdk.errors import PerfDataNotAvailableError
    from tqdm import tqdm

    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)
    models = models or list(model_catalog().values())
    version = metadata.version("aiconfigurator-core")
    rows, skipped = [], []
    jobs = [(m, g, tp) for m in models for g in gpus for tp in AIC_TP]
    with tempfile.TemporaryDirectory() as tmp:
        for model, gpu, tp in tqdm(jobs, disable=not progress, desc="aiconfigurator"):
            if tp_unsupported_reason(model, tp):
                continue
            path, how = aic_model_path(model, Path(tmp))
            try:
                rows += _tables(EngineHandle.compile(path, AIC_SYSTEMS[gpu], AIC_BACKEND, tp_size=tp,
                                                     moe_tp_size=tp, moe_ep_size=1), model, gpu, tp, how, version)
            except PerfDataNotAvailableError as exc:
                # No measured kernel for this shape (e.g. phi-4's 10 KV heads): leave it to the roofline.
                skipped.append(f"{model.alias} {gpu}:{tp}: {str(exc).removeprefix('perf database error: ').split(' for ')[0]}")
    if skipped:
        log.warning("aiconfigurator has no measured kernels for %d (model, node) pairs:\n  %s", len(skipped),
                    "\n  ".join(skipped))
    df = pd.DataFrame(rows)
    cols = ["source", "model", "gpu", "tp", "node", "phase", "tokens", "seq_tokens", "context_tokens",
            "ms_per_layer", "gemm_ms", "moe_ms", "attn_ms", "comm_ms", "other_ms", "scope", "origin"]
    df = df[cols].round({c: 5 for c in cols if c.endswith("_ms") or c == "ms_per_layer"})
    out_dir = Path(out_dir or paths.PROFILES_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    df.to_csv(out_dir / AIC_FILE, index=False)
    return df


def _tables(handle, model: ModelSpec, gpu: str, tp: int, how: str, version: str) -> list[dict]:
    """Prefill and decode rows of one compiled (model, GPU, TP) engine."""
    rows = []
    base = {"source": "measured:aiconfigurator", "model": model.alias, "gpu": gpu, "tp": tp,
            "node": f"{gpu}:{tp}", "scope": "layer",
            "origin": f"aic-{version}:{AIC_SYSTEMS[gpu]}/{AIC_BACKEND}:{how}"}
    for tokens in AIC_PREFILL_TOKENS:
        seq = min(tokens, AIC_SEQ_TOKENS)
        ctx_ops, _ = handle.run_static_per_op(batch_size=tokens // seq, isl=seq, osl=2)
        rows.append({**base, "phase": "prefill", "tokens": tokens, "seq_tokens": seq, "context_tokens": 0,
                     **_per_layer(ctx_ops, model.n_layers)})
    for ctx in AIC_CONTEXT_TOKENS:
        for batch in AIC_DECODE_BATCH:
            ops = handle.decode_step_per_op(batch, ctx, 2)
            rows.append({**base, "phase": "decode", "tokens": batch, "seq_tokens": 1, "context_tokens": ctx,
                         **_per_layer(ops, model.n_layers)})
    return rows
