"""Real vLLM (the CPU build) in a node environment built by sky_tasks/setup_node.sh, against the torch engine.

The node environment is a virtualenv cached under ~/.cache/coral/node-envs (keyed by the setup script,
pyproject.toml and the vLLM spec), so a machine builds it once; its build time is kept in `ready.json`.
vLLM as processes (pipelines, restarts, process groups) is tests/test_vllm_processes.py.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from coral_dagster.runtime.generate import generate
from coral_dagster.runtime.local import free_port
from support.vllm_node import API_KEY, node_python, post, serve_local_vllm, stop, stream

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served_vllm(node_env, tmp_path_factory):
    """One `coral serve local --engine vllm` instance the read-only tests share: its port."""
    port = free_port()
    proc, _ = serve_local_vllm(node_env, tmp_path_factory.mktemp("vllm-served"), port)
    yield port
    stop(proc)


def test_node_env_holds_the_runtime_and_vllm_without_the_planner(node_env):
    out = node_python(node_env, """
import importlib.util, json, click, vllm
print("RESULT " + json.dumps({"click": click.__version__, "vllm": vllm.__version__,
                  "planner": [m for m in ("dagster", "duckdb", "pulp", "pandas", "sky")
                              if importlib.util.find_spec(m)]}))
""")
    assert out["planner"] == [] and out["vllm"] == "0.32.0"
    assert tuple(int(x) for x in out["click"].split(".")[:2]) >= (8, 4)
    plan = subprocess.run([str(Path(node_env["VIRTUAL_ENV"]) / "bin" / "coral"), "plan", "--scenario", "core"],
                          env=node_env, capture_output=True, text=True, timeout=120)
    assert plan.returncode == 2 and "coral-dagster[planner]" in plan.stderr, plan.stderr[-2000:]


def test_coral_serve_local_with_vllm_matches_the_torch_engine(served_vllm):
    """Greedy completions through the OpenAI front door, streamed and not, several at once (vLLM batches them),
    equal the torch engine's on the same float32 weights, token for token."""
    url = f"http://127.0.0.1:{served_vllm}/v1/completions"
    prompts = ["Hello, Coral", "The quick brown fox", "a", "mixed GPUs, one pipeline"]
    expected = [generate("tiny-llama", p, 16, ignore_eos=True).tokens for p in prompts]
    to_eos = generate("tiny-llama", "Hello, Coral", 40)
    with ThreadPoolExecutor(4) as pool:
        plain = list(pool.map(lambda p: post(url, {"model": "tiny-llama", "prompt": p, "max_tokens": 16,
                                                   "ignore_eos": True, "temperature": 0}), prompts))
        streamed = list(pool.map(lambda p: stream(url, {"model": "tiny-llama", "prompt": p, "max_tokens": 16,
                                                        "ignore_eos": True, "temperature": 0}), prompts))
    assert [tuple(r["choices"][0]["token_ids"]) for r in plain] == expected
    assert [tuple(t) for t in streamed] == expected
    with_eos = post(url, {"model": "tiny-llama", "prompt": "Hello, Coral", "max_tokens": 40, "temperature": 0})
    assert tuple(with_eos["choices"][0]["token_ids"]) == to_eos.tokens
    assert with_eos["choices"][0]["finish_reason"] == to_eos.finish_reason


def test_a_pd_pair_of_vllm_instances_hands_the_kv_over_through_its_connector(node_env, tmp_path):
    """`serve local --engine vllm --pd`: the coordinator sends each request to the vLLM prefill instance (one
    token, ExampleConnector writing the prompt's KV under the log folder), then to the vLLM decode instance with the
    prompt and that token, whose connector loads the KV (vLLM logs the hit; the files are there): greedy tokens equal
    the torch engine's, several requests at once."""
    port = free_port()
    proc, ready = serve_local_vllm(node_env, tmp_path, port, ("--pd", "--instances", "2"))
    try:
        assert sorted(i["phase"] for i in ready["instances"]) == ["decode", "prefill"]
        url = f"http://127.0.0.1:{port}/v1/completions"
        # Longer than one KV block (vLLM's CPU block size), so there is KV to hand over.
        prompts = [f"{w} handed from a prefill instance to a decode instance, block by block. " * 5
                   for w in ("KV", "Cache")]
        expected = [generate("tiny-llama", p, 16, ignore_eos=True).tokens for p in prompts]
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda p: post(url, {"model": "tiny-llama", "prompt": p, "max_tokens": 16,
                                                       "ignore_eos": True, "temperature": 0}), prompts))
        assert [tuple(r["choices"][0]["token_ids"]) for r in got] == expected
        hits = (tmp_path / "decode-0.vllm.log").read_text().count("External Cache Hit!")
        assert hits >= len(prompts)
        assert len([p for p in (tmp_path / "kv").iterdir() if p.is_dir()]) >= len(prompts)
    finally:
        stop(proc)


def test_the_openai_api_behaves_the_same_through_vllm_as_through_the_torch_engine(served_vllm):
    """The parity battery (tests/support/openai_battery.py, official client): chat and completions, stop strings, echo,
    n, usage chunks, logprobs (vLLM's raw log-probabilities within float32 noise of the torch engine's), seeded
    repeats and refused fields, through `coral serve local --engine vllm`, equal the reference the torch
    engine's battery is held to in the default tier."""
    from support.openai_battery import assert_same, expected, observe

    assert_same(observe(f"http://127.0.0.1:{served_vllm}/v1", API_KEY), expected(), tolerance=1e-3)


def test_vllm_kv_cache_matches_the_memory_model(node_env):
    """vLLM's KV cache for 1 GiB equals what our memory model's per-token KV bytes give, to within one block."""
    from coral_dagster.catalog.models import get_model
    from coral_dagster.runtime.tiny import decoder_config

    out = node_python(node_env, """
import json
from coral_dagster.runtime.vllm_engine import head_engine
if __name__ == "__main__":
    e = head_engine("tiny-llama", (), gpu_memory_utilization=0.05, max_model_len=512, enforce_eager=True)
    c = e.llm.vllm_config.cache_config
    print("RESULT " + json.dumps({"tokens": e.kv_cache_tokens(), "block": c.block_size}))
""")
    cfg = decoder_config("tiny-llama")
    spec = replace(get_model(cfg.base), n_layers=cfg.n_layers, hidden=cfg.hidden, n_heads=cfg.n_heads,
                   n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, intermediate=cfg.intermediate,
                   vocab=cfg.vocab, dtype=cfg.dtype)
    ours = int(2**30 // (spec.n_layers * spec.kv_bytes_per_token_per_layer))
    assert 0 <= ours - out["tokens"] < out["block"], (ours, out)


def test_the_vllm_engine_reports_the_kv_its_scheduler_holds(node_env):
    """`kv_usage` is vLLM's own block pool use (its scheduler's `kv_cache_usage`, which leaves the null block out of
    the pool) over the cache's tokens: a 200-token prompt's blocks while it runs, none before and after."""
    out = node_python(node_env, """
import json
import numpy as np
from coral_dagster.runtime.vllm_engine import head_engine
if __name__ == "__main__":
    e = head_engine("tiny-llama", (), gpu_memory_utilization=0.05, max_model_len=512, enforce_eager=True)
    idle = e.kv_usage()
    e.submit("r", np.arange(1, 201), 100)
    while not e.step():
        pass
    held = e.kv_usage()
    e.free("r")
    c = e.llm.vllm_config.cache_config
    print("RESULT " + json.dumps({"idle": idle, "held": held, "after": e.kv_usage(), "block": c.block_size,
                                  "blocks": c.num_gpu_blocks}))
""")
    block, blocks = out["block"], out["blocks"]
    capacity = block * blocks
    assert out["idle"] == [0, capacity] and out["after"] == [0, capacity]
    # 200 prompt tokens (and the first output's slot, which 200 being no multiple of a block size leaves in them).
    assert 200 % block and out["held"] == [round(-(-200 // block) / (blocks - 1) * capacity), capacity]


def test_generated_vllm_serve_lines_parse_in_vllm(node_env):
    """Every node's `vllm serve` line of a vLLM-planned instance, parsed by vLLM's own parser, gives the
    pipeline the template describes: one rank group per node, the template's TP, the head's address."""
    from coral_dagster.runtime.vllm_engine import VllmLaunch

    launch = VllmLaunch("Qwen/Qwen3-32B", (22, 21, 21), tp=4, master_addr="10.0.0.7", master_port=29501)
    lines = [launch.argv(i) for i in range(3)]
    out = node_python(node_env, f"""
import json
from coral_dagster.runtime.vllm_engine import parse_serve_line
rows = []
for argv in {lines!r}:
    _, a = parse_serve_line(argv)
    rows.append([a.model, a.tensor_parallel_size, a.pipeline_parallel_size, a.nnodes, a.node_rank, a.master_addr,
                 a.master_port, a.headless, a.skip_tokenizer_init])
print("RESULT " + json.dumps(rows))
""")
    assert out == [["Qwen/Qwen3-32B", 4, 3, 3, i, "10.0.0.7", 29501, i > 0, True] for i in range(3)]


