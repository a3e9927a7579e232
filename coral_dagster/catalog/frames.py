"""The catalogs as DataFrames, for printing and for storing in DuckDB."""

from __future__ import annotations

from dataclasses import asdict
from typing import Callable

import pandas as pd

from coral_dagster.catalog.gpus import GIB, gpu_catalog, node_spec
from coral_dagster.catalog.nodes import GPUS_PER_NODE, NodeConfig
from coral_dagster.catalog.scenarios import load_scenario, scenario_names


def gpus_frame() -> pd.DataFrame:
    """One row per GPU type."""
    return pd.DataFrame([asdict(g) for g in gpu_catalog().values()])


def nodes_frame(prices: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per node configuration that some bundled region sells, with memory, network and price range (from
    `prices`, default: the price table in use)."""
    from coral_dagster.catalog.prices import load_node_prices

    prices = load_node_prices() if prices is None else prices
    rows = []
    for gpu in gpu_catalog():
        for count in GPUS_PER_NODE:
            node = NodeConfig(gpu, count)
            sold = prices[prices["node"] == str(node)]
            if sold.empty:
                continue
            spec = node_spec(node)
            rows.append({"node": str(node), "gpu": gpu, "gpus": count, "mem_gib": spec.mem_bytes / GIB,
                         "nic_gbps": spec.nic_gbps, "regions": len(sold),
                         "min_usd_per_hour": sold["usd_per_hour"].min(),
                         "max_usd_per_hour": sold["usd_per_hour"].max()})
    return pd.DataFrame(rows)


def models_frame() -> pd.DataFrame:
    """One row per model with its architecture and derived sizes."""
    from coral_dagster.catalog.models import model_catalog

    rows = []
    for m in model_catalog().values():
        rows.append({"alias": m.alias, "hf_id": m.hf_id, "layers": m.n_layers, "hidden": m.hidden,
                     "heads": m.n_heads, "kv_heads": m.n_kv_heads, "experts": m.n_experts,
                     "active_experts": m.n_active_experts, "params_b": m.total_params / 1e9,
                     "weights_gib": m.total_weight_bytes / GIB,
                     "weight_mib_per_layer": m.weight_bytes_per_layer / 2**20,
                     "kv_kib_per_token_per_layer": m.kv_bytes_per_token_per_layer / 1024,
                     "activation_bytes_per_token": m.activation_bytes_per_token})
    return pd.DataFrame(rows)


def prices_frame(prices: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (region, node configuration) sold, with on-demand and spot $/node-hour (`prices`, default: the
    price table in use)."""
    from coral_dagster.catalog.prices import load_node_prices

    return (load_node_prices() if prices is None else prices).copy()


def scenarios_frame() -> pd.DataFrame:
    """One row per (scenario, model) with SLOs, trace and rate."""
    rows = []
    for name in scenario_names():
        s = load_scenario(name)
        for m in s.models:
            rows.append({"scenario": name, "model": m.model, "prefill_slo_ms": m.prefill_slo_ms,
                         "decode_slo_ms": m.decode_slo_ms, "trace": m.trace, "rate_req_s": m.rate_req_s,
                         "regions": ",".join(s.regions), "node_configs": len(s.node_configs)})
    return pd.DataFrame(rows)


#: The catalogs priced from the price table (they take it as `prices`).
PRICED_FRAMES = ("nodes", "prices")
CATALOG_FRAMES: dict[str, Callable[..., pd.DataFrame]] = {
    "gpus": gpus_frame, "nodes": nodes_frame, "models": models_frame, "prices": prices_frame,
    "scenarios": scenarios_frame}
