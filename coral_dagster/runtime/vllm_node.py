"""The engine node in front of a vLLM instance's head: one submission per request, tokens streamed back."""

from __future__ import annotations

import time
from typing import Any

from coral_dagster.runtime.engine import Step
from coral_dagster.runtime.node import EngineNode
from coral_dagster.runtime.protocol import Kind
from coral_dagster.runtime.vllm_engine import PREFILL_KV_PARAMS, VllmEngine


class VllmNode(EngineNode[VllmEngine]):
    """Speaks the engine-node protocol to the scheduler; a `forward` carries the prompt and `max_tokens` once,
    and every token vLLM produces goes to the scheduler as it appears (`free` aborts the request in vLLM).

    In a PD pair a forward with a `handoff` is a prefill (its token goes back with the `kv_transfer_params` vLLM
    finished it with, {} when the connector returns none), one with `kv_transfer_params` a decode."""

    streams = True

    def _run_batch(self, batch: list[tuple[dict[str, Any], Step]]) -> None:
        for h, step in batch:
            if step.pos != 0 or step.tokens is None or not isinstance(h.get("max_tokens"), int):
                self._error(step.rid, f"a vLLM instance takes each request once, from position 0, with max_tokens "
                                      f"(got position {step.pos}, max_tokens {h.get('max_tokens')!r})")
                continue
            prefill = bool(h.get("handoff"))
            try:
                self.engine.submit(step.rid, step.tokens, h["max_tokens"], step.sampling,
                                   dict(PREFILL_KV_PARAMS) if prefill else h.get("kv_transfer_params"))
            except (TypeError, ValueError) as exc:
                # vLLM's own checks (token ids, prompt and max_tokens against max_model_len) fault the request
                # itself: a 4xx, not retried on another instance.
                self._error(step.rid, f"vLLM did not take the request: {exc}", 400)
        self.steps_run += 1

    def _advance(self) -> bool:
        if not self.engine.has_work():
            return False
        try:
            produced = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - vLLM's engine failing fails its requests, reported by name
            for rid in list(self._touched):
                self._error(rid, f"vLLM step failed: {exc}")
            return False
        now = time.monotonic()
        for rid, token, pos, logprobs in produced:
            self._touched[rid] = now
            extra: dict[str, Any] = {"logprobs": logprobs.message()} if logprobs else {}
            if rid in self.engine.kv_params:
                extra["kv_transfer_params"] = self.engine.kv_params.pop(rid)
            if rid in self.engine.prompt_logprobs:
                extra["prompt_logprobs"] = [lp.message() for lp in self.engine.prompt_logprobs.pop(rid)]
            self._to_scheduler({"kind": Kind.TOKEN, "rid": rid, "token": token, "pos": pos, **extra})
        return self.engine.has_work()
