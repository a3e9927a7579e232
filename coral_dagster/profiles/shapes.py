"""The layer shape the performance model works from: what one transformer layer multiplies and stores."""

from __future__ import annotations

from dataclasses import dataclass

from coral_dagster.catalog.models import ModelSpec


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer's dimensions; `sliding_fraction` of layers attend over at most `sliding_window` tokens."""

    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    gated: bool = True
    n_experts: int = 0
    n_active_experts: int = 0
    expert_intermediate: int = 0
    n_shared_experts: int = 0
    sliding_window: int = 0
    sliding_fraction: float = 0.0
    weight_bytes_per_param: float = 2.0
    expert_bytes_per_param: float = 2.0

    @classmethod
    def of(cls, model: ModelSpec) -> "LayerShape":
        """The shape of a catalog model's (mean) layer."""
        return cls(
            hidden=model.hidden, n_heads=model.n_heads, n_kv_heads=model.n_kv_heads, head_dim=model.head_dim,
            intermediate=model.intermediate, gated=True, n_experts=model.n_experts,
            n_active_experts=model.n_active_experts, expert_intermediate=model.expert_intermediate,
            n_shared_experts=model.n_shared_experts, sliding_window=model.sliding_window,
            sliding_fraction=model.n_sliding_layers / model.n_layers,
            weight_bytes_per_param=model.weight_bytes_per_param,
            expert_bytes_per_param=model.expert_bytes_per_param,
        )

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def attention_linear_params(self) -> int:
        """q, k, v and output projections."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return 2 * self.hidden * q + 2 * self.hidden * kv

    @property
    def expert_params(self) -> int:
        """Matrix parameters of one gated expert."""
        return 3 * self.hidden * self.expert_intermediate

    @property
    def dense_params(self) -> int:
        """Parameters every token multiplies by: attention projections, the dense MLP or the router and shared
        experts."""
        if not self.is_moe:
            return self.attention_linear_params + (3 if self.gated else 2) * self.hidden * self.intermediate
        return self.attention_linear_params + self.hidden * self.n_experts + self.n_shared_experts * self.expert_params

    @property
    def activated_width(self) -> int:
        """Width of the MLP activation each token computes (dense MLP, or its routed plus shared experts)."""
        if not self.is_moe:
            return self.intermediate
        return (self.n_active_experts + self.n_shared_experts) * self.expert_intermediate

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of one token in one layer, uncapped by any window."""
        return 2 * self.n_kv_heads * self.head_dim * self.weight_bytes_per_param
