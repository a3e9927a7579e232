"""Aggregated instances as vLLM runs them: chunked prefill fused into the decode step, in the simulator and in the
template T̂ that plans them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from coral_dagster.allocation.types import Plan, PlannedInstance
from coral_dagster.catalog.models import get_model
from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.simulator.engine import OK, Engine
from coral_dagster.profiles.stage_times import ProfileStage, fused_step_ms
from coral_dagster.simulator.latency import ProfileLatencyModel
from coral_dagster.simulator.reach import template_reach
from coral_dagster.simulator.workload import Workload
from coral_dagster.templates.best import best_for_nodes
from coral_dagster.templates.types import Stage, Template
from support.node_env import node_python

# A layer block whose pass reads its weights in WEIGHTS_MS and adds PER_PROMPT_MS per prompt token and
# PER_SEQ_MS per decode sequence: one pass over both costs WEIGHTS_MS once.
WEIGHTS_MS, PER_PROMPT_MS, PER_SEQ_MS = 10.0, 0.01, 0.1
NODE = NodeConfig("L40S", 2)


@dataclass(frozen=True)
class AffineStage:
    kv_capacity_tokens: float = math.inf

    def prefill_ms(self, tokens, seq_tokens, past_tokens=0.0):
        return WEIGHTS_MS + PER_PROMPT_MS * tokens

    def decode_ms(self, batch, context_tokens):
        return WEIGHTS_MS + PER_SEQ_MS * batch


class AffineLatency:
    def stage(self, model, node, layers):
        return AffineStage()


def _aggregated(budget_tokens: int) -> Template:
    n = get_model("phi-4").n_layers
    return Template("phi-4", "aggregated", 60.0, NodeMultiset.of([NODE]),
                    (Stage(0, n, (NODE,), (1.0,), (budget_tokens,)),), 1.0, "compute")


def test_a_step_with_decodes_and_a_prompt_chunk_reads_the_weights_once():
    # r0 (100-token prompt, 50 tokens out) arrives at 0; r1 (100 tokens) at 30 ms, while r0 decodes. By hand: r0's
    # prefill step takes 10 + 1 = 11 ms, its decode steps 10.1 ms each (11, 21.1, 31.2 ms ends); the step starting
    # at 31.2 ms holds r0's decode and r1's whole prompt (budget 1000 tokens): 10 + 0.1 + 1 = 11.1 ms as one pass
    # (two passes would take 21.1), so r1's first token comes 31.2 + 11.1 − 30 = 12.3 ms after it arrived.
    wl = Workload(("phi-4",), np.array([0.0, 0.030]), np.array([0, 0]), np.array([100, 100]), np.array([50, 3]), 1.0)
    plan = Plan("t", "reach", "optimal", 0.0, 0.0, 0.0, 0.0, (PlannedInstance(_aggregated(1000), "r", 1, 0.0),), {}, {})
    out = Engine(plan, wl, AffineLatency()).run()
    assert list(out.status) == [OK, OK]
    assert (out.ttft_s[0] - 0.0) * 1000 == pytest.approx(11.0)
    assert (out.ttft_s[1] - 0.030) * 1000 == pytest.approx(31.2 + 11.1 - 30.0)


def test_decode_tokens_count_in_the_step_token_budget():
    # Budget 60 tokens: the step at 31.2 ms holds r0's decode token and 59 of r1's prompt tokens (vLLM schedules
    # running requests first, then chunks a waiting prompt to what is left of max_num_batched_tokens); the rest,
    # 41 tokens ride the next step beside r0's next token; r1's first token ends that step.
    wl = Workload(("phi-4",), np.array([0.0, 0.030]), np.array([0, 0]), np.array([50, 100]), np.array([50, 3]), 1.0)
    plan = Plan("t", "reach", "optimal", 0.0, 0.0, 0.0, 0.0, (PlannedInstance(_aggregated(60), "r", 1, 0.0),), {}, {})
    out = Engine(plan, wl, AffineLatency()).run()
    r0_prefill = WEIGHTS_MS + PER_PROMPT_MS * 50
    steps = [r0_prefill] + [WEIGHTS_MS + PER_SEQ_MS] * 10
    start = next(e for e in np.cumsum(steps) if e >= 30.0)  # the first step boundary after r1 arrives
    first = WEIGHTS_MS + PER_SEQ_MS + PER_PROMPT_MS * 59  # r0's token and 59 prompt tokens, one pass
    second = WEIGHTS_MS + PER_SEQ_MS + PER_PROMPT_MS * 41  # r0's token and the prompt's last 41 tokens
    assert (out.ttft_s[1] - 0.030) * 1000 == pytest.approx(start + first + second - 30.0)


def test_fused_step_on_the_shipped_model_is_one_weight_read_cheaper():
    from coral_dagster.profiles import default_perf_model

    lat = ProfileStage(default_perf_model(), get_model("phi-4"), NODE, 40, math.inf)
    weights_ms = lat.prefill_ms(1, 1, 0.0)  # a one-token pass: the weight read, nearly all of it
    for batch, chunk in ((1, 64), (16, 256), (64, 512), (128, 2048)):
        fused = fused_step_ms(lat, batch, batch * 1260, chunk, chunk, 0.0)
        apart = lat.decode_ms(batch, batch * 1260) + lat.prefill_ms(chunk, chunk, 0.0)
        assert lat.decode_ms(batch, batch * 1260) < fused < apart
        if batch + chunk <= 300:  # both below the roofline's ridge: apart, the chunk reads the weights again
            assert apart - fused > 0.9 * weights_ms
    assert fused_step_ms(lat, 8, 8 * 1260, 0, 1) == lat.decode_ms(8, 8 * 1260)
    assert fused_step_ms(lat, 0, 0, 300, 300) == lat.prefill_ms(300, 300)


@pytest.mark.slow
@pytest.mark.parametrize("model, nodes", [("phi-4", "1xL40S:2"), ("qwen3-32b", "1xL40S:2"),
                                          ("gpt-oss-20b", "1xL40S:2"), ("phi-4", "1xL40S:1,1xL40S:2")])
def test_aggregated_templates_hold_their_slos_at_t_hat_and_not_far_beyond(model, nodes):
    """The template's T̂ against the simulator's fused steps (Poisson arrivals, the model's trace lengths): at 95%
    of T̂ a share ≥ 0.93 of requests meets both SLOs (the plan's target 0.95, less one seed's noise), and at 3× T̂
    under 0.9 of them do (T̂ is not a small fraction of what the instance serves)."""
    scn = load_scenario("core")
    t, _, _ = best_for_nodes(model, "aggregated", nodes, scenario="core")
    assert t.tokens_per_s > 0 and all(s.batches for s in t.stages)
    latency = ProfileLatencyModel()
    at = template_reach(t, scn, load=0.95, seed=1, min_requests=600, latency=latency)
    over = template_reach(t, scn, load=3.0, seed=1, min_requests=600, latency=latency)
    assert at.attainment >= 0.93, at
    assert over.attainment < 0.9, over


VLLM_STEPS = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
path, budget, early, late = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
llm = LLM(model=path, skip_tokenizer_init=True, max_num_batched_tokens=budget, max_num_seqs=8,
          enable_chunked_prefill=True, max_model_len=512, dtype="float32", enforce_eager=True,
          enable_prefix_caching=False)
engine = llm.llm_engine
scheduler = engine.engine_core.engine_core.scheduler
steps, schedule = [], scheduler.schedule
def recorded(*args, **kwargs):
    out = schedule(*args, **kwargs)
    steps.append({rid.split("-")[0]: n for rid, n in out.num_scheduled_tokens.items()})
    return out
scheduler.schedule = recorded
def add(name, prompt, output):
    engine.add_request(name, {"prompt_token_ids": [5 + i % 50 for i in range(prompt)]},
                       SamplingParams(max_tokens=output, ignore_eos=True, detokenize=False))
for name, prompt, output in early:
    add(name, prompt, output)
for _ in range(3):
    engine.step()
for name, prompt, output in late:
    add(name, prompt, output)
while engine.has_unfinished_requests():
    engine.step()
print("STEPS " + json.dumps(steps))
"""


@pytest.mark.slow
def test_simulator_steps_are_vllm_cpu_schedulers(tmp_path, vllm_node_env):
    """vLLM 0.32's own scheduler (the CPU build, in tests/test_vllm_cpu.py's node environment) against the
    simulator: two requests decode while a 150-token prompt arrives at a 64-token budget. vLLM's steps give the
    running requests one token each and the prompt what is left of the budget; priced as one pass each with the
    affine latency above, they put the prompt's first token where the simulator puts it, in as many steps."""
    import json
    import os
    import subprocess

    from coral_dagster.runtime.hf_export import export_tiny
    python = node_python(vllm_node_env)
    budget, early, late = 64, [["a", 20, 12], ["b", 30, 12]], [["long", 150, 2]]
    done = subprocess.run([str(python), "-c", VLLM_STEPS, str(export_tiny("tiny-llama")), str(budget),
                           json.dumps(early), json.dumps(late)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
                                             "VLLM_CPU_OMP_THREADS_BIND": "0"})
    line = next((x for x in done.stdout.splitlines() if x.startswith("STEPS ")), None)
    assert line, done.stderr[-3000:]
    steps = json.loads(line[6:])
    prompts = {name: prompt for name, prompt, _ in early + late}
    seen: dict[str, int] = {}
    ms = []
    for step in steps:
        assert sum(step.values()) <= budget
        decodes = sum(1 for name, n in step.items() if seen.get(name, 0) >= prompts[name])
        chunk = sum(n for name, n in step.items() if seen.get(name, 0) < prompts[name])
        if decodes and chunk:  # running requests first, the prompt takes what is left of the budget
            assert chunk == min(budget - decodes, prompts["long"] - seen.get("long", 0))
        ms.append(WEIGHTS_MS + PER_SEQ_MS * decodes + PER_PROMPT_MS * chunk)
        for name, n in step.items():
            seen[name] = seen.get(name, 0) + n
    ends = np.cumsum(ms)
    arrival_ms = ends[2] - 0.1  # during vLLM's third step, before its fourth is scheduled
    first_token_step = next(i for i in range(len(steps))
                            if sum(s.get("long", 0) for s in steps[:i + 1]) >= prompts["long"])
    wl = Workload(("phi-4",), np.array([0.0, 0.0, arrival_ms / 1000]), np.array([0, 0, 0]),
                  np.array([20, 30, 150]), np.array([12, 12, 2]), 1.0)
    plan = Plan("t", "reach", "optimal", 0.0, 0.0, 0.0, 0.0, (PlannedInstance(_aggregated(budget), "r", 1, 0.0),),
                {}, {})
    out = Engine(plan, wl, AffineLatency()).run()
    assert (out.ttft_s[2] * 1000 - arrival_ms) == pytest.approx(ends[first_token_step] - arrival_ms)
    assert out.nodes[0]["iterations"] == len(steps)
    assert out.nodes[0]["prefill_tokens"] == sum(prompts.values())
