"""GPU check for one H200 (run by bench/gpu_check.sh inside the node environment): Coral serving with vLLM,
a 2-rank uneven vLLM pipeline as two "nodes" on one GPU, and per-layer vLLM timings next to `coral profile
latency`. Prints a table and writes bench/results/gpu_check.json."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "gpu_check.json"
ROOT = Path(__file__).resolve().parent.parent
PLANNER_PY = os.environ.get("CORAL_PLANNER_PYTHON", "")
MODEL = "llama-3.1-70b"  # its layer shape, dummy weights: nothing is downloaded
PREFILL_TOKENS, DECODE_BATCH, CONTEXT = 1024, 16, 1024
SHALLOW, DEEP = 2, 6


def _free_port() -> int:
    from coral_dagster.runtime.local import free_port

    return free_port()


def serve_through_coral() -> dict:
    """`coral serve local --engine vllm` on the GPU: greedy completions against the torch engine."""
    from coral_dagster.runtime.generate import generate

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "coral_dagster.cli.serve", "local", "--engine", "vllm",
                             "--model", "tiny-llama", "--instances", "1", "--port", str(port), "--json",
                             "--vllm-args", "--gpu-memory-utilization 0.2 --max-model-len 512 --enforce-eager"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ready = json.loads(proc.stdout.readline() or "{}")
        prompts = ["Hello, Coral", "mixed GPUs, one pipeline"]
        got = []
        for p in prompts:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(
                {"model": "tiny-llama", "prompt": p, "max_tokens": 16, "ignore_eos": True}).encode(),
                {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                got.append(json.loads(r.read())["choices"][0]["token_ids"])
        want = [list(generate("tiny-llama", p, 16, ignore_eos=True).tokens) for p in prompts]
        return {"ready": bool(ready.get("ready")), "identical": got == want, "vllm": got, "torch": want}
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)


def two_rank_pipeline() -> dict:
    """tiny-llama split 5,7 over two vLLM "nodes" (the head here, rank 1 headless) sharing the GPU."""
    import numpy as np

    from coral_dagster.runtime.generate import generate
    from coral_dagster.runtime.vllm_engine import VllmEngine, VllmLaunch, vllm_model

    path, n_layers, vocab, dtype = vllm_model("tiny-llama")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # held_layers() sends a function to the workers
    port = _free_port()
    launch = VllmLaunch(path, (5, 7), dtype=dtype, master_port=port, max_model_len=512,
                        gpu_memory_utilization=0.2, enforce_eager=True)
    worker = subprocess.Popen([sys.executable, "-m", "coral_dagster.cli.serve", "engine", "--engine", "vllm",
                               "--model", "tiny-llama", "--layers", f"0:{n_layers}", "--stage-rank", "0",
                               "--split", "5,7", "--node-rank", "1", "--vllm-port", str(port),
                               "--max-model-len", "512", "--gpu-memory-utilization", "0.2", "--enforce-eager"],
                              start_new_session=True)
    try:
        engine = VllmEngine(launch, n_layers, vocab)
        held = engine.held_layers()
        prompt = [256, *b"Hello, Coral"]
        engine.submit("r", np.asarray(prompt), 16)
        tokens = []
        while engine.has_work():
            tokens += [t for _, t, _ in engine.step()]
        want = list(generate("tiny-llama", "Hello, Coral", 16, ignore_eos=True).tokens)
        return {"split": [5, 7], "layers_per_rank": held, "expected": [list(range(5)), list(range(5, 12))],
                "tokens_identical": tokens == want}
    finally:
        os.killpg(worker.pid, 15)
        worker.wait(timeout=60)


def _dummy_model(layers: int) -> str:
    """A config-only Hugging Face directory with MODEL's layer shape; vLLM fills it with dummy weights."""
    from coral_dagster.catalog.models import get_model

    m = get_model(MODEL)
    out = Path(tempfile.mkdtemp(prefix=f"coral-{MODEL}-{layers}l-"))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": m.hidden,
        "intermediate_size": m.intermediate, "num_hidden_layers": layers, "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads, "head_dim": m.head_dim, "vocab_size": m.vocab, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16"}))
    return str(out)


def _timings(layers: int) -> tuple[float, float]:
    """(prefill ms of one PREFILL_TOKENS prompt, decode ms per step of DECODE_BATCH sequences at CONTEXT)."""
    from vllm import LLMEngine, SamplingParams

    from coral_dagster.runtime.vllm_engine import VllmLaunch, engine_args

    launch = VllmLaunch(_dummy_model(layers), (layers,), dtype="bfloat16", max_model_len=4096,
                        gpu_memory_utilization=0.5, enforce_eager=True)
    llm = LLMEngine.from_engine_args(engine_args([*launch.argv(0), "--load-format", "dummy",
                                                  "--no-enable-prefix-caching"]))
    one = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    prefill = []
    for i in range(6):
        llm.add_request(f"p{i}", {"prompt_token_ids": [7 + i] * PREFILL_TOKENS}, one)
        t = time.perf_counter()
        while llm.has_unfinished_requests():
            llm.step()
        prefill.append(1000 * (time.perf_counter() - t))
    many = SamplingParams(max_tokens=40, ignore_eos=True, detokenize=False)
    for i in range(DECODE_BATCH):
        llm.add_request(f"d{i}", {"prompt_token_ids": [11 + i] * CONTEXT}, many)
    steps = []
    while llm.has_unfinished_requests():
        t = time.perf_counter()
        llm.step()
        steps.append(1000 * (time.perf_counter() - t))
    del llm
    # Skip the warm-up prefill and the prefill steps of the decode batch.
    return statistics.median(prefill[1:]), statistics.median(steps[DECODE_BATCH + 5:])


def _coral_latency(phase: str) -> float | None:
    if not PLANNER_PY:
        return None
    args = (["--tokens", str(PREFILL_TOKENS), "--seq-tokens", str(PREFILL_TOKENS)] if phase == "prefill"
            else ["--batch", str(DECODE_BATCH), "--context", str(CONTEXT)])
    out = subprocess.run([PLANNER_PY, "-c", "from coral_dagster.cli.main import main; main()", "profile",
                          "latency", "--model", MODEL, "--node", "H200:1", "--phase", phase, *args, "--json"],
                         capture_output=True, text=True, cwd=ROOT, check=True)
    doc = json.loads(out.stdout)
    return float(doc["ms_per_layer"])


def per_layer() -> dict:
    (p2, d2), (p6, d6) = _timings(SHALLOW), _timings(DEEP)
    measured = {"prefill": (p6 - p2) / (DEEP - SHALLOW), "decode": (d6 - d2) / (DEEP - SHALLOW)}
    return {"model": MODEL, "node": "H200:1", "prefill_tokens": PREFILL_TOKENS, "decode_batch": DECODE_BATCH,
            "context": CONTEXT, "measured_ms_per_layer": measured,
            "coral_profile_ms_per_layer": {ph: _coral_latency(ph) for ph in measured}}


def main() -> None:
    started = time.monotonic()
    doc = {"serve": serve_through_coral(), "pipeline": two_rank_pipeline(), "per_layer": per_layer()}
    doc["wall_s"] = round(time.monotonic() - started, 1)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=2))
    pl = doc["per_layer"]
    print(f"{'check':<34}{'result'}")
    print(f"{'coral serve local --engine vllm':<34}identical to torch engine: {doc['serve']['identical']}")
    print(f"{'2-rank pipeline 5,7':<34}layers {doc['pipeline']['layers_per_rank']}, "
          f"tokens identical: {doc['pipeline']['tokens_identical']}")
    for ph in ("prefill", "decode"):
        print(f"{ph + ' ms/layer (vLLM | coral)':<34}{pl['measured_ms_per_layer'][ph]:.3f} | "
              f"{pl['coral_profile_ms_per_layer'][ph]}")
    print(f"wrote {RESULTS} ({doc['wall_s']} s)")


if __name__ == "__main__":
    main()
