"""Model catalog: parameter counts against model cards and HF's own modeling code, sizes, lookups, validation."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from coral_dagster import paths
from coral_dagster.catalog.models import get_model, load_models, model_catalog
from coral_dagster.errors import CatalogError, UnknownNameError

GIB = 1024**3

# Billions of parameters as published (total, active per token for MoE), independent of the YAML:
# HF model pages (phi-4, Llama-3.1-70B, Llama-2-70b-hf), Qwen3 model cards, gpt-oss model card Table 1
# (arXiv 2508.10925), LLaMA paper Table 2 (arXiv 2302.13971).
PUBLISHED = {
    "phi-4": (14.7, None),
    "gpt-oss-20b": (20.91, 3.61),
    "qwen3-32b": (32.8, None),
    "llama-3.1-70b": (70.6, None),
    "gpt-oss-120b": (116.83, 5.13),
    "qwen3-235b-a22b": (235.0, 22.0),
    "llama-2-70b": (69.0, None),
    "llama-1-30b": (32.5, None),
}

# config.json files in the aiconfigurator-core wheel, for the models it ships.
WHEEL_CONFIGS = {
    "gpt-oss-20b": "openai--gpt-oss-20b_config.json",
    "gpt-oss-120b": "openai--gpt-oss-120b_config.json",
    "qwen3-32b": "Qwen--Qwen3-32B_config.json",
    "qwen3-235b-a22b": "Qwen--Qwen3-235B-A22B_config.json",
    "llama-3.1-70b": "meta-llama--Meta-Llama-3.1-70B_config.json",
}


def test_catalog_holds_the_eight_models():
    assert set(model_catalog()) == set(PUBLISHED)


@pytest.mark.parametrize("alias", sorted(PUBLISHED))
def test_total_params_match_published(alias):
    m = get_model(alias)
    total_b, active_b = PUBLISHED[alias]
    assert m.published_params == total_b
    assert m.total_params / 1e9 == pytest.approx(total_b, rel=0.02)
    if active_b is not None:
        assert m.is_moe and m.published_active_params == active_b
        assert m.active_params_per_token / 1e9 == pytest.approx(active_b, rel=0.05)


def _hf_config(m):
    from transformers import AutoConfig

    kw = dict(hidden_size=m.hidden, num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
              num_key_value_heads=m.n_kv_heads, head_dim=m.head_dim, intermediate_size=m.intermediate,
              vocab_size=m.vocab, tie_word_embeddings=m.tie_embeddings, attention_bias=m.attention_bias)
    if m.model_type == "qwen3_moe":
        kw.update(num_experts=m.n_experts, num_experts_per_tok=m.n_active_experts,
                  moe_intermediate_size=m.expert_intermediate)
    if m.model_type == "gpt_oss":
        kinds = ["sliding_attention", "full_attention"]
        kw.update(num_local_experts=m.n_experts, num_experts_per_tok=m.n_active_experts,
                  intermediate_size=m.expert_intermediate, sliding_window=m.sliding_window,
                  layer_types=[kinds[i % 2] for i in range(m.n_layers)])
    return AutoConfig.for_model(m.model_type, **kw)


@pytest.mark.parametrize("alias", sorted(PUBLISHED))
def test_param_count_equals_transformers_model(alias):
    """Second formulation: HF's modeling code instantiated on the meta device (no memory), every tensor counted."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    m = get_model(alias)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_hf_config(m))
    assert sum(p.numel() for p in model.parameters()) == m.total_params


@pytest.mark.parametrize("alias", sorted(WHEEL_CONFIGS))
def test_architecture_matches_wheel_config(alias):
    spec = importlib.util.find_spec("aiconfigurator_core")
    if spec is None:
        pytest.skip("aiconfigurator-core not installed")
    path = Path(spec.origin).parent / "model_configs" / WHEEL_CONFIGS[alias]
    c = json.loads(path.read_text())
    m = get_model(alias)
    assert c["model_type"] == m.model_type
    assert (c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
            c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]), c["intermediate_size"],
            c["vocab_size"], c["tie_word_embeddings"]) == (
        m.n_layers, m.hidden, m.n_heads, m.n_kv_heads, m.head_dim, m.intermediate, m.vocab, m.tie_embeddings)
    assert c.get("num_experts", c.get("num_local_experts", 0)) == m.n_experts
    assert c.get("num_experts_per_tok", 0) == m.n_active_experts
    layer_types = c.get("layer_types", [])
    assert layer_types.count("sliding_attention") == m.n_sliding_layers
    assert (c.get("sliding_window") or 0) == (m.sliding_window if m.n_sliding_layers else 0)


@pytest.mark.parametrize("alias, gib", [("gpt-oss-120b", 60.8), ("gpt-oss-20b", 12.8)])
def test_gpt_oss_weight_bytes_match_checkpoint_size(alias, gib):
    """gpt-oss model card Table 1 checkpoint sizes (MXFP4 experts, bf16 rest)."""
    assert get_model(alias).total_weight_bytes / GIB == pytest.approx(gib, rel=0.02)


def test_llama31_70b_sizes_by_hand():
    m = get_model("llama-3.1-70b")
    assert m.kv_bytes_per_token_per_layer == 2 * 8 * 128 * 2 == 4096
    assert m.kv_bytes_per_layer(8192) == 8192 * 4096
    attention = 8192 * 8192 * 2 + 8192 * 1024 * 2
    mlp = 3 * 8192 * 28672
    assert m.weight_bytes_per_layer == (attention + mlp + 2 * 8192) * 2
    assert m.embedding_bytes == 2 * 128256 * 8192 * 2
    assert m.activation_bytes_per_token == 8192 * 2
    tied = dataclasses.replace(m, tie_embeddings=True)
    assert tied.embedding_bytes == m.embedding_bytes / 2
    assert tied.total_weight_bytes == m.total_weight_bytes - 128256 * 8192 * 2


def test_dense_active_params_skip_only_the_input_embedding():
    m = get_model("qwen3-32b")
    assert m.active_params_per_token == m.total_params - m.vocab * m.hidden


def test_sliding_window_layers_cap_their_kv():
    m = get_model("gpt-oss-120b")
    per_token = 2 * 8 * 64 * 2
    assert m.kv_bytes_per_token_per_layer == per_token
    assert m.kv_bytes_per_layer(100) == 100 * per_token
    assert m.kv_bytes_per_layer(10_000) == (18 * 10_000 + 18 * 128) / 36 * per_token
    assert m.kv_bytes_per_layer(10_000) < 10_000 * m.kv_bytes_per_token_per_layer


def test_get_model_by_alias_or_hf_id_any_case():
    assert get_model("Qwen/Qwen3-32B") is get_model("qwen3-32b")
    assert get_model("QWEN/qwen3-32b") is get_model("QWEN3-32B")
    assert get_model("openai/gpt-oss-20b").alias == "gpt-oss-20b"


def test_unknown_model_lists_aliases():
    with pytest.raises(UnknownNameError) as exc:
        get_model("llama-4-scout")
    assert "llama-4-scout" in str(exc.value)
    for alias in PUBLISHED:
        assert alias in str(exc.value)


def _good_rows():
    return yaml.safe_load((paths.CATALOG_DIR / "models.yaml").read_text())["models"]


def _set(key, value):
    return lambda r: r.__setitem__(key, value)


@pytest.mark.parametrize("base, edit, field_name", [
    ("phi-4", lambda r: r.pop("hidden"), "hidden"),
    ("phi-4", _set("n_layers", "forty"), "n_layers"),
    ("phi-4", _set("tie_embeddings", "no"), "tie_embeddings"),
    ("phi-4", _set("published_params", "14.7B"), "published_params"),
    ("phi-4", _set("n_layers", 0), "n_layers"),
    ("phi-4", _set("vocab", -5), "vocab"),
    ("phi-4", _set("n_experts", -1), "n_experts"),
    ("phi-4", _set("dtype", "int4"), "dtype"),
    ("phi-4", _set("n_kv_heads", 7), "n_kv_heads"),
    ("gpt-oss-20b", _set("n_active_experts", 33), "n_active_experts"),
    ("gpt-oss-20b", lambda r: r.pop("published_active_params"), "published_active_params"),
    ("gpt-oss-20b", _set("expert_intermediate", 0), "expert_intermediate"),
    ("phi-4", _set("n_shared_experts", 1), "n_experts"),
    ("gpt-oss-20b", _set("n_sliding_layers", 0), "sliding_window"),
    ("phi-4", _set("alias", "qwen3-32b"), "alias"),
    ("phi-4", _set("hf_id", "qwen/QWEN3-32B"), "hf_id"),
])
def test_bad_entry_names_file_entry_and_field(tmp_path, base, edit, field_name):
    rows = {r["alias"]: r for r in _good_rows()}
    bad = dict(rows[base])
    edit(bad)
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump({"models": [rows["qwen3-32b"], bad]}))
    with pytest.raises(CatalogError) as exc:
        load_models(path)
    err = exc.value
    assert (err.field, err.row) == (field_name, 1)
    assert str(path) in str(err) and "row 1" in str(err) and repr(field_name) in str(err)
    assert "Fix:" in str(err)


def test_missing_file_and_bad_top_level(tmp_path):
    with pytest.raises(CatalogError, match="file not found"):
        load_models(tmp_path / "absent.yaml")
    path = tmp_path / "models.yaml"
    path.write_text("models: {phi-4: 1}\n")
    with pytest.raises(CatalogError, match="models"):
        load_models(path)
