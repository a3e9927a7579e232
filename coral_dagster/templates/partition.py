"""The pipeline layer split in the form vLLM takes it (`VLLM_PP_LAYER_PARTITION="a,b,c"`), validated likewise."""

from __future__ import annotations

from coral_dagster.errors import CoralError


def parse_pp_partition(partition: str, num_hidden_layers: int, pp_size: int | None = None) -> tuple[int, ...]:
    """Layers per stage from `"a,b,c"`: integers, one per stage, each positive, summing to the model's layers."""
    try:
        parts = tuple(int(p) for p in partition.split(","))
    except ValueError:
        raise CoralError(f"invalid partition string: {partition!r}.", "write layers per stage as 'a,b,c', e.g. '20,20'.")
    if pp_size is not None and len(parts) != pp_size:
        raise CoralError(f"{len(parts)=} does not match {pp_size=}.", "give one layer count per pipeline stage.")
    if any(p <= 0 for p in parts):
        raise CoralError(f"every stage needs at least one layer, got {partition=}.", "remove empty stages.")
    if sum(parts) != num_hidden_layers:
        raise CoralError(f"{sum(parts)=} does not match {num_hidden_layers=}.",
                         "make the layer counts add up to the model's layers.")
    return parts


def pp_indices(num_hidden_layers: int, pp_rank: int, pp_size: int, partition: str) -> tuple[int, int]:
    """`[start, end)` layers of stage `pp_rank` under `partition`, as vLLM's `get_pp_indices` computes them."""
    parts = parse_pp_partition(partition, num_hidden_layers, pp_size)
    if not 0 <= pp_rank < pp_size:
        raise CoralError(f"{pp_rank=} is outside 0..{pp_size - 1}.", "use a stage rank below the stage count.")
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]
