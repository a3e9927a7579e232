"""The vLLM engine for GPU nodes: vLLM runs an instance's stages with Coral's uneven layer split.

Untested here (no GPU, vLLM not installed). vLLM has no public API to drive one pipeline stage from outside,
so this adapter holds the whole instance: vLLM's own pipeline parallelism places the stages on the instance's
nodes (Ray) using `VLLM_PP_LAYER_PARTITION`, and the Coral node in front of it is a one-stage instance to the
scheduler. Each step re-submits the request's tokens with prefix caching on, so only the new tokens are computed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from coral_dagster.errors import CoralError
from coral_dagster.runtime.engine import Engine, Step, StepOutput, validate_layers


def vllm_env(split: Sequence[int]) -> dict[str, str]:
    """Environment that makes vLLM split layers as the template does (vLLM checks the sum itself)."""
    return {"VLLM_PP_LAYER_PARTITION": ",".join(str(n) for n in split)}


class VllmEngine(Engine):
    """Every layer of a catalog model behind vLLM (`tp` GPUs per node, one pipeline stage per split entry)."""

    def __init__(self, model: str, start: int, end: int, split: tuple[int, ...] = (), tp: int = 1) -> None:
        from coral_dagster.catalog.models import get_model

        spec = get_model(model)
        validate_layers(start, end, spec.n_layers)
        if (start, end) != (0, spec.n_layers):
            raise CoralError(f"the vLLM engine holds a whole instance, not layers {start}:{end}.",
                             f"run one vLLM node per instance with --layers 0:{spec.n_layers} --split "
                             f"{','.join(map(str, split)) or spec.n_layers}; vLLM places the stages itself")
        try:
            from vllm import LLM, SamplingParams
        except ImportError:
            raise CoralError("vLLM is not installed on this node.",
                             "install the GPU extra (`pip install coral-dagster[gpu]`) or use --engine torch") from None
        split = split or (spec.n_layers,)
        os.environ.update(vllm_env(split))
        self.start, self.end, self.n_layers, self.vocab = 0, spec.n_layers, spec.n_layers, spec.vocab
        self.llm = LLM(model=spec.hf_id, tensor_parallel_size=tp, pipeline_parallel_size=len(split),
                       enable_prefix_caching=True,
                       distributed_executor_backend="ray" if len(split) > 1 else None)
        self.params = SamplingParams(temperature=0.0, max_tokens=1)
        self._tokens: dict[str, list[int]] = {}

    def forward(self, steps: list[Step]) -> list[StepOutput]:
        prompts = []
        for s in steps:
            history = self._tokens.setdefault(s.rid, [])
            if len(history) != s.pos:
                raise ValueError(f"request {s.rid}: step at position {s.pos} but {len(history)} tokens are known")
            history.extend(int(t) for t in np.asarray(s.tokens))
            prompts.append({"prompt_token_ids": list(history)})
        outputs = self.llm.generate(prompts, self.params, use_tqdm=False)
        return [StepOutput(s.rid, token=int(o.outputs[0].token_ids[0])) for s, o in zip(steps, outputs)]

    def cache_length(self, rid: str) -> int | None:
        return len(self._tokens.get(rid, ()))

    def export_kv(self, rid: str, start: int, end: int) -> list[np.ndarray]:
        raise CoralError("the vLLM adapter does not hand KV over node to node.",
                         "run PD with vLLM's own KV connector (kv_transfer_config), or aggregated instances")

    def import_kv(self, rid: str, start: int, end: int, arrays: list[np.ndarray]) -> None:
        self.export_kv(rid, start, end)

    def free(self, rid: str) -> None:
        self._tokens.pop(rid, None)
