"""Convert the public measured profiles (Helix per-layer timings, Vidur operator timings) into `data/profiles/`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd

from coral_dagster import paths
from coral_dagster.paths import HELIX_FILE, VIDUR_FILE
from coral_dagster.errors import CoralError

#: Helix node directory -> (GPU type in our catalog, GPUs per node).
HELIX_NODES = {
    "A100-40GB_x1": ("A100", 1), "L4_x1": ("L4", 1), "L4_x2": ("L4", 2), "T4_x1": ("T4", 1), "T4_x2": ("T4", 2),
    "T4_x4": ("T4", 4), "V100-16GB_x1": ("V100", 1),
}
#: Helix profiled with its Azure-conversation length constants (simulator/event_simulator/utils.py:
#: AVG_INPUT_LEN = 750, AVG_OUTPUT_LEN = 240). Prompts are taken as 750 tokens, decode context as the mean
#: context half-way through the output, 750 + 240 / 2 = 870 tokens. These are our assumptions; the tables do not
#: say.
HELIX_SEQ_TOKENS = 750
HELIX_CONTEXT_TOKENS = 870
#: Vidur GPU directory -> our GPU type.
VIDUR_GPUS = {"a100": "A100-80GB", "h100": "H100", "a40": "A40"}
#: Vidur operators of one layer that `mlp.csv` times (everything but attention itself and the all-reduce);
#: `add` (residual add) runs twice per layer.
VIDUR_OPS = {"input_layernorm": 1, "attn_pre_proj": 1, "attn_rope": 1, "attn_post_proj": 1,
             "post_attention_layernorm": 1, "mlp_up_proj": 1, "mlp_act": 1, "mlp_down_proj": 1, "add": 2}
#: Token counts kept from Vidur's tables (they sample every 8 tokens; a geometric subset is enough to fit).
VIDUR_TOKENS = sorted({b * m for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
                       for m in (1, 3)} | {32768})

HELIX_MEMORY_FILE = "helix_memory.json"


def _require(path: Path) -> Path:
    if not path.exists():
        raise CoralError(f"public profile {path} not found.",
                         "pass --from the folder holding profiles/helix-llama1-30b and profiles/vidur "
                         "(../shared/data in this project's workspace).")
    return path


def convert_helix(shared_dir: Path, out_dir: Path) -> pd.DataFrame:
    """Helix's per-layer prefill/decode tables for LLaMA-1-30B as one long table; copies memory.json."""
    root = _require(Path(shared_dir) / "profiles" / "helix-llama1-30b")
    rows = []
    for name, (gpu, count) in HELIX_NODES.items():
        for phase, file in (("prefill", "prefill.csv"), ("decode", "decode.csv")):
            df = pd.read_csv(_require(root / name / file))
            for r in df.itertuples(index=False):
                if r.tokens_in_batch <= 0:
                    continue
                tokens = int(r.tokens_in_batch)
                rows.append({
                    "source": "measured:helix", "model": "llama-1-30b", "gpu": gpu, "tp": count,
                    "node": f"{gpu}:{count}", "phase": phase, "tokens": tokens,
                    "seq_tokens": min(tokens, HELIX_SEQ_TOKENS) if phase == "prefill" else 1,
                    "context_tokens": HELIX_CONTEXT_TOKENS if phase == "decode" else 0,
                    "ms_per_layer": float(r.ms_per_layer), "scope": "layer", "origin": f"{name}/{file}",
                })
    out = pd.DataFrame(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    out.to_csv(out_dir / HELIX_FILE, index=False)
    shutil.copyfile(_require(root / "memory.json"), out_dir / HELIX_MEMORY_FILE)
    return out


def convert_vidur(shared_dir: Path, out_dir: Path) -> pd.DataFrame:
    """Vidur's non-attention operator times per layer (sum of medians) by GPU, model, TP degree and tokens."""
    root = _require(Path(shared_dir) / "profiles" / "vidur" / "compute")
    rows = []
    for gpu_dir, gpu in VIDUR_GPUS.items():
        for csv in sorted((root / gpu_dir).glob("*/*/mlp.csv")):
            model = f"{csv.parent.parent.name}/{csv.parent.name}"
            df = pd.read_csv(csv)
            df = df[df["num_tokens"].isin(VIDUR_TOKENS)]
            ms = sum(k * df.get(f"time_stats.{op}.median", 0.0) for op, k in VIDUR_OPS.items())
            for r, total in zip(df.itertuples(index=False), ms):
                rows.append({
                    "source": "measured:vidur", "model": model, "gpu": gpu, "tp": int(r.num_tensor_parallel_workers),
                    "phase": "any", "tokens": int(r.num_tokens), "ms_per_layer": float(total),
                    "scope": "non-attention", "hidden": int(r.n_embd), "n_heads": int(r.n_head),
                    "n_kv_heads": int(r.n_kv_head), "intermediate": int(r.n_expanded_embd),
                    "gated": bool(r.use_gated_mlp), "origin": f"compute/{gpu_dir}/{model}/mlp.csv",
                })
    out = pd.DataFrame(rows).sort_values(["gpu", "model", "tp", "tokens"], kind="stable")
    out_dir.mkdir(parents=True, exist_ok=True)
    out.to_csv(out_dir / VIDUR_FILE, index=False)
    return out


def import_public_profiles(shared_dir: Path | str, out_dir: Path | None = None) -> dict[str, int]:
    """Convert both public sources; returns rows written per file."""
    out_dir = Path(out_dir or paths.PROFILES_DIR)
    helix = convert_helix(Path(shared_dir), out_dir)
    vidur = convert_vidur(Path(shared_dir), out_dir)
    return {HELIX_FILE: len(helix), VIDUR_FILE: len(vidur)}


def helix_memory(profiles_dir: Path | None = None) -> dict:
    """Helix's memory.json as shipped."""
    return json.loads((Path(profiles_dir or paths.PROFILES_DIR) / HELIX_MEMORY_FILE).read_text())
