"""Reduced-size Llama-style decoders derived from catalog architectures, so the real protocol runs on a CPU."""

from __future__ import annotations

from dataclasses import dataclass

from coral_dagster.catalog.models import ModelSpec, get_model, model_catalog
from coral_dagster.errors import CoralError, UnknownNameError

TINY_PREFIX = "tiny-"
TINY_ALIASES = {"tiny-llama": "llama-3.1-70b"}
LLAMA3_ROPE_THETA = 500_000.0


@dataclass(frozen=True)
class DecoderConfig:
    """A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, untied LM head."""

    name: str
    base: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float = LLAMA3_ROPE_THETA
    norm_eps: float = 1e-5
    max_context: int = 4096
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise CoralError(f"{self.name}: {self.n_heads=} is not a multiple of {self.n_kv_heads=}.",
                             "pick a head count that keeps the grouped-query ratio whole")


def _eligible(spec: ModelSpec) -> bool:
    """Dense Llama-style models only: no experts, QK-norm, biases, sinks or sliding windows."""
    return not (spec.is_moe or spec.qk_norm or spec.attention_bias or spec.attention_sinks
                or spec.sliding_window)


def reduce_architecture(spec: ModelSpec, name: str, n_layers: int = 12, hidden: int = 256,
                        head_dim: int = 32, vocab: int = 512) -> DecoderConfig:
    """`spec` shrunk to `n_layers` × `hidden`, keeping its GQA ratio and MLP-to-hidden ratio.

    32 is the smallest head size vLLM's CPU attention runs, so the same tiny models serve under vLLM.
    """
    n_heads = hidden // head_dim
    group = spec.n_heads // spec.n_kv_heads
    if n_heads % group:
        raise CoralError(f"{name}: {n_heads} heads cannot keep {spec.alias}'s {group}:1 grouped-query ratio.",
                         f"choose hidden/head_dim as a multiple of {group}")
    intermediate = max(16, round(spec.intermediate * hidden / spec.hidden / 16) * 16)
    return DecoderConfig(name=name, base=spec.alias, n_layers=n_layers, hidden=hidden, n_heads=n_heads,
                         n_kv_heads=n_heads // group, head_dim=head_dim, intermediate=intermediate, vocab=vocab)


def tiny_names() -> list[str]:
    """Every model name the torch engine can build."""
    names = set(TINY_ALIASES)
    names |= {TINY_PREFIX + m.alias for m in model_catalog().values() if _eligible(m)}
    return sorted(names)


def decoder_config(name: str) -> DecoderConfig:
    """The reduced decoder called `name` (`tiny-llama`, or `tiny-<dense catalog alias>`)."""
    key = name.lower()
    base = TINY_ALIASES.get(key) or (key[len(TINY_PREFIX):] if key.startswith(TINY_PREFIX) else None)
    if base is None or key not in tiny_names():
        raise UnknownNameError("runtime model", name, tiny_names())
    return reduce_architecture(get_model(base), key)
