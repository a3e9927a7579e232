"""The profile table: per (model, node, phase) latency by batch, memory sizes and source, for DuckDB and `data/`."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import pandas as pd

from coral_dagster import paths
from coral_dagster.catalog.gpus import node_spec
from coral_dagster.catalog.models import ModelSpec, get_model
from coral_dagster.catalog.nodes import NodeConfig
from coral_dagster.profiles import memory as mem
from coral_dagster.profiles.perf import PerfModel, default_perf_model

TABLE_PREFILL_TOKENS = (1, 16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
TABLE_DECODE_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TABLE_CONTEXT_TOKENS = (512, 2048, 8192)
COLUMNS = ["model", "node", "gpu", "gpus", "phase", "tokens", "seq_tokens", "context_tokens", "ms_per_layer",
           "weight_bytes_per_layer", "kv_bytes_per_token_per_layer", "engine_reserve_bytes", "max_layers", "source"]


def profile_table(models: Iterable[ModelSpec | str], nodes: Iterable[NodeConfig | str],
                  perf: PerfModel | None = None) -> pd.DataFrame:
    """One row per (model, node, phase, batch[, context]): `tokens` is prompt tokens for prefill and sequences for
    decode; memory columns are per layer for the whole node (KV replicated when GPUs outnumber KV heads)."""
    perf = perf or default_perf_model()
    rows = []
    for model in (m if isinstance(m, ModelSpec) else get_model(m) for m in models):
        for node in (node_spec(n) for n in nodes):
            common = {
                "model": model.alias, "node": str(node.config), "gpu": node.gpu.name, "gpus": node.config.count,
                "weight_bytes_per_layer": model.weight_bytes_per_layer,
                "kv_bytes_per_token_per_layer": model.kv_bytes_per_token_per_layer
                * mem.kv_replication(model, node.config.count),
                "engine_reserve_bytes": perf.engine_reserve_bytes(model, node),
                "max_layers": perf.max_layers(model, node),
            }
            seq = perf.prefill_seq_tokens
            curve = perf.curve(model, node, "prefill", seq)
            rows += [{**common, "phase": "prefill", "tokens": t, "seq_tokens": min(t, seq), "context_tokens": 0,
                      "ms_per_layer": curve(t), "source": curve.source} for t in TABLE_PREFILL_TOKENS]
            for ctx in TABLE_CONTEXT_TOKENS:
                curve = perf.curve(model, node, "decode", ctx)
                rows += [{**common, "phase": "decode", "tokens": b, "seq_tokens": 1, "context_tokens": ctx,
                          "ms_per_layer": curve(b), "source": curve.source} for b in TABLE_DECODE_BATCH]
    return pd.DataFrame(rows, columns=COLUMNS)


def scenario_profile_table(scenario: str, perf: PerfModel | None = None) -> pd.DataFrame:
    """The profile table of a bundled scenario's models and node configurations."""
    from coral_dagster.catalog.scenarios import load_scenario

    sc = load_scenario(scenario)
    return profile_table([m.model for m in sc.models], sc.node_configs, perf)


def write_scenario_tables(scenarios: Iterable[str] = ("core", "extended", "helix"),
                          out_dir: Path | None = None) -> dict[str, int]:
    """Ship `profiles_<scenario>.csv` under `data/profiles/`; returns rows per file."""
    out_dir = Path(out_dir or paths.PROFILES_DIR)
    counts = {}
    for name in scenarios:
        df = scenario_profile_table(name)
        path = out_dir / f"profiles_{name}.csv"
        df.round({"ms_per_layer": 5, "engine_reserve_bytes": 0}).to_csv(path, index=False)
        counts[path.name] = len(df)
    return counts
