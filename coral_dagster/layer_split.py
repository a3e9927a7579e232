"""The pipeline layer split as vLLM takes it (`VLLM_PP_LAYER_PARTITION="a,b,c"`): one parser for the planner and
the GPU-node runtime (it imports nothing of the project but its errors)."""

from __future__ import annotations

from coral_dagster.errors import CoralError


def parse_split(text: str, num_layers: int | None = None, stages: int | None = None) -> tuple[int, ...]:
    """`"3,5,4"` -> (3, 5, 4): layers per stage, each a positive integer; with `stages`, one per stage, and with
    `num_layers`, summing to the model's layers (vLLM refuses any other partition)."""
    try:
        split = tuple(int(x) for x in text.split(","))
    except ValueError:
        split = ()
    if not split or any(n <= 0 for n in split):
        raise CoralError(f"layer split {text!r} is not a list of positive layer counts.",
                         "write layers per stage as 'a,b,c', e.g. --split 3,5,4.")
    if stages is not None and len(split) != stages:
        raise CoralError(f"layer split {text!r} has {len(split)} stages, not {stages}.",
                         "give one layer count per pipeline stage.")
    if num_layers is not None and sum(split) != num_layers:
        raise CoralError(f"layer split {text!r} holds {sum(split)} layers, the model has {num_layers}.",
                         "make the layer counts add up to the model's layers.")
    return split


def stage_ranges(split: tuple[int, ...]) -> list[tuple[int, int]]:
    """Layer range `[start, end)` of each stage (vLLM's `get_pp_indices` under the same partition)."""
    bounds = [0]
    for n in split:
        bounds.append(bounds[-1] + n)
    return list(zip(bounds[:-1], bounds[1:]))
