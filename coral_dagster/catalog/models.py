"""Model architectures and the weight, KV-cache and activation sizes derived from them."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from coral_dagster import paths
from coral_dagster.catalog._load import check_unique, field, read_yaml, rows_of
from coral_dagster.errors import CatalogError, CoralError, UnknownNameError

BYTES_PER_PARAM = {"bfloat16": 2.0, "float16": 2.0, "float32": 4.0}


@dataclass(frozen=True)
class ModelSpec:
    """One decoder-only transformer as its HF config describes it; every layer has the same weights."""

    alias: str
    hf_id: str
    model_type: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    attention_sinks: bool
    n_experts: int
    n_active_experts: int
    expert_intermediate: int
    n_shared_experts: int
    moe_bias: bool
    sliding_window: int
    n_sliding_layers: int
    dtype: str
    expert_bytes_per_param: float
    published_params: float
    published_active_params: float = 0.0
    # vLLM's `--tool-call-parser` for the model's family, as vLLM's tool-calling docs list it ("": none listed).
    tool_call_parser: str = ""

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def weight_bytes_per_param(self) -> float:
        """Bytes of every weight that is not an expert matrix, and of KV cache and activation elements."""
        return BYTES_PER_PARAM[self.dtype]

    def _attention_params(self) -> int:
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        params = 2 * self.hidden * q + 2 * self.hidden * kv
        if self.attention_bias:
            params += q + 2 * kv + self.hidden
        if self.qk_norm:
            params += 2 * self.head_dim
        if self.attention_sinks:
            params += self.n_heads
        return params

    def _expert_params(self) -> tuple[int, int]:
        """(matrix, bias) parameters of one gated expert."""
        matrices = 3 * self.hidden * self.expert_intermediate
        return matrices, (2 * self.expert_intermediate + self.hidden) if self.moe_bias else 0

    def _layer_params(self, experts: int) -> tuple[int, int]:
        """(params stored in `dtype`, expert matrix params) of one layer holding `experts` experts."""
        plain = self._attention_params() + 2 * self.hidden
        if not self.is_moe:
            return plain + 3 * self.hidden * self.intermediate, 0
        matrices, bias = self._expert_params()
        plain += self.hidden * self.n_experts + (self.n_experts if self.moe_bias else 0)
        return plain + experts * bias, experts * matrices

    @property
    def layer_params(self) -> int:
        return sum(self._layer_params(self.n_experts + self.n_shared_experts))

    @property
    def weight_bytes_per_layer(self) -> float:
        """Mean bytes of one layer's weights: attention, MLP or experts and router, norms."""
        plain, expert = self._layer_params(self.n_experts + self.n_shared_experts)
        return plain * self.weight_bytes_per_param + expert * self.expert_bytes_per_param

    @property
    def kv_bytes_per_token_per_layer(self) -> float:
        """K and V of one token in one layer; sliding-window layers counted as if uncapped."""
        return 2 * self.n_kv_heads * self.head_dim * self.weight_bytes_per_param

    def kv_bytes_per_layer(self, context_tokens: int) -> float:
        """Mean KV bytes per layer for one sequence of `context_tokens`, sliding layers capped at the window."""
        full = self.n_layers - self.n_sliding_layers
        windowed = min(context_tokens, self.sliding_window) if self.n_sliding_layers else 0
        tokens = (full * context_tokens + self.n_sliding_layers * windowed) / self.n_layers
        return tokens * self.kv_bytes_per_token_per_layer

    @property
    def activation_bytes_per_token(self) -> float:
        """The hidden state one token carries between pipeline stages."""
        return self.hidden * self.weight_bytes_per_param

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    @property
    def embedding_bytes(self) -> float:
        """Input embedding plus LM head (once when tied)."""
        return self.embedding_params * self.weight_bytes_per_param

    @property
    def total_params(self) -> int:
        """All parameters: layers, embeddings, final norm."""
        return self.n_layers * self.layer_params + self.embedding_params + self.hidden

    @property
    def total_weight_bytes(self) -> float:
        return (self.n_layers * self.weight_bytes_per_layer + self.embedding_bytes
                + self.hidden * self.weight_bytes_per_param)

    @property
    def active_params_per_token(self) -> int:
        """Parameters one token's forward pass multiplies by: routed and shared experts only, LM head, but not the
        input embedding (a table lookup), as the gpt-oss model card counts active parameters."""
        layer = sum(self._layer_params(self.n_active_experts + self.n_shared_experts))
        return self.n_layers * layer + self.vocab * self.hidden + self.hidden


def _count(row: dict, name: str, path: Path, idx: int) -> int:
    value = field(row, name, int, path, idx)
    if value < 0:
        raise CatalogError(path, idx, name, f"{value!r} must not be negative", f"give {name} 0 or more")
    return value


def _parse(row: dict, path: Path, i: int) -> ModelSpec:
    dtype = field(row, "dtype", str, path, i)
    if dtype not in BYTES_PER_PARAM:
        raise CatalogError(path, i, "dtype", f"{dtype!r} is not a supported weight dtype",
                           f"use one of {', '.join(BYTES_PER_PARAM)}")
    m = ModelSpec(
        alias=field(row, "alias", str, path, i),
        hf_id=field(row, "hf_id", str, path, i),
        model_type=field(row, "model_type", str, path, i),
        **{k: field(row, k, int, path, i, positive=True) for k in (
            "n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "intermediate", "vocab")},
        **{k: field(row, k, bool, path, i) for k in (
            "tie_embeddings", "attention_bias", "qk_norm", "attention_sinks", "moe_bias")},
        n_experts=_count(row, "n_experts", path, i),
        n_active_experts=_count(row, "n_active_experts", path, i),
        expert_intermediate=_count(row, "expert_intermediate", path, i),
        n_shared_experts=_count(row, "n_shared_experts", path, i),
        sliding_window=_count(row, "sliding_window", path, i),
        n_sliding_layers=_count(row, "n_sliding_layers", path, i),
        dtype=dtype,
        expert_bytes_per_param=field(row, "expert_bytes_per_param", float, path, i, positive=True),
        published_params=field(row, "published_params", float, path, i, positive=True),
        published_active_params=field(row, "published_active_params", float, path, i, default=0.0),
        tool_call_parser=field(row, "tool_call_parser", str, path, i, default=""),
    )
    _check_shape(m, path, i)
    return m


def _check_shape(m: ModelSpec, path: Path, i: int) -> None:
    """Cross-field rules that single-field checks cannot see."""
    if m.n_heads % m.n_kv_heads:
        raise CatalogError(path, i, "n_kv_heads", f"{m.alias}: n_heads={m.n_heads} is not a multiple of "
                           f"n_kv_heads={m.n_kv_heads}", "copy num_key_value_heads from the model's config.json")
    if m.n_active_experts > m.n_experts:
        raise CatalogError(path, i, "n_active_experts", f"{m.alias}: n_active_experts={m.n_active_experts} "
                           f"exceeds n_experts={m.n_experts}", "copy num_experts_per_tok from config.json")
    for name in ("n_active_experts", "expert_intermediate", "published_active_params"):
        if m.is_moe and getattr(m, name) <= 0:
            raise CatalogError(path, i, name, f"{m.alias}: an MoE entry (n_experts={m.n_experts}) needs {name} "
                               "above 0", f"add {name} from the model's config.json or model card")
    if not m.is_moe and (m.n_active_experts or m.expert_intermediate or m.n_shared_experts):
        raise CatalogError(path, i, "n_experts", f"{m.alias}: n_experts is 0 (dense) but expert fields are set",
                           "set n_active_experts, expert_intermediate and n_shared_experts to 0, or n_experts")
    if m.n_sliding_layers > m.n_layers:
        raise CatalogError(path, i, "n_sliding_layers", f"{m.alias}: n_sliding_layers={m.n_sliding_layers} "
                           f"exceeds n_layers={m.n_layers}", "count the sliding_attention entries of layer_types")
    if bool(m.sliding_window) != bool(m.n_sliding_layers):
        raise CatalogError(path, i, "sliding_window", f"{m.alias}: sliding_window={m.sliding_window} with "
                           f"n_sliding_layers={m.n_sliding_layers}", "set both above 0, or both to 0")


def load_models(path: Path | str | None = None) -> dict[str, ModelSpec]:
    """Read and validate `models.yaml`; keys are aliases in file order."""
    path = Path(path or paths.CATALOG_DIR / "models.yaml")
    models = [_parse(r, path, i) for i, r in enumerate(rows_of(read_yaml(path), "models", path))]
    check_unique([m.alias.lower() for m in models], path, "alias")
    check_unique([m.hf_id.lower() for m in models], path, "hf_id")
    return {m.alias: m for m in models}


@lru_cache(maxsize=None)
def model_catalog() -> dict[str, ModelSpec]:
    """The bundled model catalog, read once."""
    return load_models()


def get_model(name: str) -> ModelSpec:
    """A model by alias or HF id, case-insensitive, or by a served model's name (its base's spec); unknown names
    list the aliases."""
    found = _catalog_model(name)
    if found is not None:
        return found
    if name not in _SERVED:
        _declare_bundled_served()
    if name in _SERVED:
        return model_catalog()[_SERVED[name][0]]
    raise UnknownNameError("model", name, [*model_catalog(), *_SERVED])


def model_name(name: str) -> str:
    """The name a model goes by in scenarios and plans: a catalog model's alias (from its alias or HF id, any case),
    a served model's own name; unknown names raise as in `get_model`."""
    found = _catalog_model(name)
    if found is not None:
        return found.alias
    get_model(name)
    return name


def served_names() -> list[str]:
    """Names of the served models declared so far, those of the bundled scenarios included."""
    _declare_bundled_served()
    return sorted(_SERVED)


def _catalog_model(name: str) -> ModelSpec | None:
    key = name.lower()
    for m in model_catalog().values():
        if key in (m.alias.lower(), m.hf_id.lower()):
            return m
    return None


# Served models (vLLM's --served-model-name): a name a deployment serves with the weights shape of a catalog model,
# its base (a fine-tune of it). Scenario files declare them (`base:` in a `models:` entry); served name -> (base,
# the file that declared it).
_SERVED: dict[str, tuple[str, str]] = {}


def declare_served(name: str, base: str, where: str) -> None:
    """Record that `name` is served with `base`'s architecture (declared in `where`); a name may not shadow a
    catalog model nor be declared with two bases."""
    if _catalog_model(name) is not None:
        raise CoralError(f"{where}: served model {name!r} has the name of a catalog model.",
                         f"give the served model a name of its own (e.g. {name}-ft), or drop `base:` to serve "
                         "the catalog model itself.")
    if base not in model_catalog():
        raise UnknownNameError(f"base model of served model {name!r} ({where})", base, list(model_catalog()))
    known = _SERVED.get(name, (base, where))
    if known[0] != base and known[1] != where:  # a file edited since it was read may change its own entries
        raise CoralError(f"served model {name!r} has base {base} in {where} but {known[0]} in {known[1]}.",
                         "give the served model one base everywhere, or name the two differently.")
    _SERVED[name] = (base, where)


def _declare_bundled_served() -> None:
    """Declare the served models of the bundled scenarios, so that a process that has loaded none knows them. Only
    their `model`/`base` pairs are read (a GPU node's runtime has PyYAML but not the planner's stack that
    `catalog.scenarios` needs); `coral catalog scenarios` and the tests check the files in full."""
    for path in sorted(paths.SCENARIOS_DIR.glob("*.y*ml")):
        doc = read_yaml(path)
        rows = doc.get("models") if isinstance(doc, dict) else None
        for row in rows if isinstance(rows, list) else ():
            if isinstance(row, dict) and isinstance(row.get("model"), str) and isinstance(row.get("base"), str):
                declare_served(row["model"], row["base"], str(path.resolve()))
