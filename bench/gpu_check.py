"""GPU check for one H200 (run by bench/gpu_check.sh inside the node environment): Coral serving with vLLM
(completions and chat), a 2-rank uneven vLLM pipeline as two "nodes" on one GPU, per-layer vLLM timings next to
`coral profile latency`, vLLM's measured fused steps (decodes plus a chunk of prefill in one pass) next to the
fused aggregated step model, and a prefill/decode pair handing KV over through a vLLM KV connector. Prints a
table and writes bench/results/gpu_check.json.

The fused step model is `profiles.stage_times.fused_step_ms` (the aggregated T̂ of `templates/throughput.py`
prices steps with it), run in the planner environment; should it fail there, `fused_model_ms_per_layer` is null
and `fused_model_error` says why, beside the measured times."""

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

from bench._results import RESULTS as RESULTS_DIR, write_result
from coral_dagster.vocab import DEMAND_PHASES

ROOT = Path(__file__).resolve().parent.parent

RESULTS = RESULTS_DIR / "gpu_check.json"
PLANNER_PY = os.environ.get("CORAL_PLANNER_PYTHON", "")
MODEL = "llama-3.1-70b"  # its layer shape, dummy weights: nothing is downloaded
PREFILL_TOKENS, DECODE_BATCH, CONTEXT = 1024, 16, 1024
SHALLOW, DEEP = 2, 6
# Fused steps: DECODE_BATCH decodes plus a FUSED_CHUNK-token chunk of a FUSED_PROMPT-token prompt per step
# (vLLM's token budget set to their sum, so every step of that prompt's prefill holds both).
FUSED_CHUNK, FUSED_PROMPT = PREFILL_TOKENS, 4 * PREFILL_TOKENS
API_KEY = "gpu-check-key"
# The KV connector of the PD pair: vLLM's reference ExampleConnector (KV through shared storage), which runs the
# two instances one after the other. The deployment's NixlConnector (templates/engines.py) needs both live at once
# and the prefill's kv_transfer_params handed to the decode request: not covered here.
CONNECTOR = "ExampleConnector"


def _free_port() -> int:
    from coral_dagster.runtime.local import free_port

    return free_port()


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def serve_through_coral() -> dict:
    """`coral serve local --engine vllm` on the GPU: greedy completions and a chat completion (the model's chat
    template) against the torch engine, and seeded sampling repeated."""
    from coral_dagster.runtime.generate import generate
    from coral_dagster.runtime.tokenizer import apply_chat_template

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "coral_dagster.cli.serve", "local", "--engine", "vllm",
                             "--model", "tiny-llama", "--instances", "1", "--port", str(port), "--json",
                             "--api-key", API_KEY,
                             "--vllm-args", "--gpu-memory-utilization 0.2 --max-model-len 512 --enforce-eager"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ready = json.loads(proc.stdout.readline() or "{}")
        prompts = ["Hello, Coral", "mixed GPUs, one pipeline"]
        got = [_post(port, "/v1/completions", {"model": "tiny-llama", "prompt": p, "max_tokens": 16,
                                               "ignore_eos": True})["choices"][0]["token_ids"] for p in prompts]
        want = [list(generate("tiny-llama", p, 16, ignore_eos=True).tokens) for p in prompts]
        messages = [{"role": "user", "content": "Name a reef."}]
        chat = _post(port, "/v1/chat/completions", {"model": "tiny-llama", "messages": messages, "max_tokens": 16,
                                                    "ignore_eos": True})["choices"][0]["message"]["content"]
        sampled = [_post(port, "/v1/completions", {"model": "tiny-llama", "prompt": prompts[0], "max_tokens": 16,
                                                   "temperature": 0.8, "seed": 3, "ignore_eos": True}
                         )["choices"][0]["text"] for _ in range(2)]
        return {"ready": bool(ready.get("ready")), "identical": got == want, "vllm": got, "torch": want,
                "chat_identical": chat == generate("tiny-llama", apply_chat_template(messages), 16,
                                                   ignore_eos=True).text,
                "seeded_repeats": sampled[0] == sampled[1]}
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
            tokens += [t for _, t, _, _ in engine.step()]
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


def _timings(layers: int) -> tuple[float, float, float]:
    """(prefill ms of one PREFILL_TOKENS prompt, decode ms per step of DECODE_BATCH sequences at CONTEXT, ms per
    fused step of those decodes plus a FUSED_CHUNK-token chunk of a FUSED_PROMPT-token prompt)."""
    from vllm import LLMEngine, SamplingParams

    from coral_dagster.runtime.vllm_engine import VllmLaunch, engine_args

    launch = VllmLaunch(_dummy_model(layers), (layers,), dtype="bfloat16", max_model_len=8192,
                        gpu_memory_utilization=0.5, enforce_eager=True)
    llm = LLMEngine.from_engine_args(engine_args([
        *launch.argv(0), "--load-format", "dummy", "--no-enable-prefix-caching",
        "--max-num-batched-tokens", str(DECODE_BATCH + FUSED_CHUNK)]))
    one = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    prefill = []
    for i in range(6):
        llm.add_request(f"p{i}", {"prompt_token_ids": [7 + i] * PREFILL_TOKENS}, one)
        t = time.perf_counter()
        while llm.has_unfinished_requests():
            llm.step()
        prefill.append(1000 * (time.perf_counter() - t))
    many = SamplingParams(max_tokens=200, ignore_eos=True, detokenize=False)
    for i in range(DECODE_BATCH):
        llm.add_request(f"d{i}", {"prompt_token_ids": [11 + i] * CONTEXT}, many)
    steps = []
    for _ in range(DECODE_BATCH + 45):
        t = time.perf_counter()
        llm.step()
        steps.append(1000 * (time.perf_counter() - t))
    # The decodes go on while a long prompt is prefilled beside them, one chunk per step.
    llm.add_request("long", {"prompt_token_ids": [5] * FUSED_PROMPT}, one)
    fused, first = [], False
    while not first:
        t = time.perf_counter()
        outs = llm.step()
        fused.append(1000 * (time.perf_counter() - t))
        first = any(o.request_id == "long" and o.outputs and o.outputs[0].token_ids for o in outs)
    for rid in [f"d{i}" for i in range(DECODE_BATCH)]:
        llm.abort_request([rid])
    del llm
    # Skip the warm-up prefill and the prefill steps of the decode batch.
    return statistics.median(prefill[1:]), statistics.median(steps[DECODE_BATCH + 5:]), statistics.median(fused)


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


def _fused_model() -> dict:
    """The fused aggregated step model's ms per layer for the measured fused step, and the unfused sum (decode step
    plus prefill chunk priced apart) beside it, from the planner environment; {"error": …} where it cannot run."""
    if not PLANNER_PY:
        return {"error": "no planner environment (CORAL_PLANNER_PYTHON)"}
    code = f"""
import json, math
from coral_dagster.catalog.models import get_model
from coral_dagster.catalog.nodes import NodeConfig
from coral_dagster.profiles import default_perf_model
try:
    from coral_dagster.profiles.stage_times import ProfileStage, fused_step_ms
except ImportError as exc:
    print(json.dumps({{"error": f"fused step model not in this checkout: {{exc}}"}}))
    raise SystemExit(0)
lat = ProfileStage(default_perf_model(), get_model({MODEL!r}), NodeConfig.parse("H200:1"), 1, math.inf)
b, ctx, c, p = {DECODE_BATCH}, {CONTEXT}, {FUSED_CHUNK}, {FUSED_PROMPT}
past = (p - c) / 2.0
print(json.dumps({{"fused_ms_per_layer": fused_step_ms(lat, b, b * ctx, c, c, past),
                  "unfused_ms_per_layer": lat.decode_ms(b, b * ctx) + lat.prefill_ms(c, c, past)}}))
"""
    out = subprocess.run([PLANNER_PY, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def per_layer() -> dict:
    (p2, d2, f2), (p6, d6, f6) = _timings(SHALLOW), _timings(DEEP)
    measured = {"prefill": (p6 - p2) / (DEEP - SHALLOW), "decode": (d6 - d2) / (DEEP - SHALLOW),
                "fused": (f6 - f2) / (DEEP - SHALLOW)}
    model = _fused_model()
    return {"model": MODEL, "node": "H200:1", "prefill_tokens": PREFILL_TOKENS, "decode_batch": DECODE_BATCH,
            "context": CONTEXT, "fused_chunk": FUSED_CHUNK, "fused_prompt": FUSED_PROMPT,
            "measured_ms_per_layer": measured,
            "coral_profile_ms_per_layer": {ph: _coral_latency(ph) for ph in DEMAND_PHASES},
            "fused_model_ms_per_layer": model.get("fused_ms_per_layer"),
            "unfused_model_ms_per_layer": model.get("unfused_ms_per_layer"), "fused_model_error": model.get("error")}


def pd_pair() -> dict:
    """A prefill instance and a decode instance of tiny-llama (one after the other on this GPU) handing the KV
    cache over through vLLM's KV connector CONNECTOR: the decode instance loads the prompt's KV (its cached-token
    count says so) and its tokens equal the torch engine's greedy ones."""
    from vllm import LLMEngine, SamplingParams

    from coral_dagster.runtime.generate import generate
    from coral_dagster.runtime.tokenizer import ByteTokenizer
    from coral_dagster.runtime.vllm_engine import VllmLaunch, engine_args, vllm_model
    from coral_dagster.templates.engines import vllm_kv_transfer_config

    path, n_layers, _, dtype = vllm_model("tiny-llama")
    text = "Prefill here, decode there: one KV cache handed over between two vLLM instances. " * 2
    prompt = ByteTokenizer().encode(text)
    storage = tempfile.mkdtemp(prefix="coral-kv-")

    def run(role: str, max_tokens: int):
        config = vllm_kv_transfer_config(role, CONNECTOR, engine_id=f"gpu-check-{role}",
                                         extra={"shared_storage_path": storage})
        launch = VllmLaunch(path, (n_layers,), dtype=dtype, max_model_len=512, gpu_memory_utilization=0.2,
                            enforce_eager=True)
        llm = LLMEngine.from_engine_args(engine_args([*launch.argv(0), "--kv-transfer-config",
                                                      json.dumps(config)]))
        llm.add_request(role, {"prompt_token_ids": prompt},
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False))
        tokens, cached = [], None
        while llm.has_unfinished_requests():
            for o in llm.step():
                tokens = list(o.outputs[0].token_ids)  # cumulative: every token so far
                cached = o.num_cached_tokens if o.num_cached_tokens is not None else cached
        del llm
        return tokens, cached

    try:
        first, _ = run("prefill", 1)
        tokens, cached = run("decode", 16)
    except Exception as exc:  # noqa: BLE001 - the GPU build may lack the connector: reported, not fatal
        return {"connector": CONNECTOR, "error": repr(exc)}
    want = list(generate("tiny-llama", text, 16, ignore_eos=True).tokens)
    return {"connector": CONNECTOR, "prompt_tokens": len(prompt), "decode_cached_tokens": cached,
            "kv_loaded": bool(cached), "first_token_identical": first == want[:1], "tokens_identical": tokens == want,
            "decode_tokens": tokens, "torch_tokens": want}


def main() -> None:
    started = time.monotonic()
    doc = {"serve": serve_through_coral(), "pipeline": two_rank_pipeline(), "per_layer": per_layer(),
           "pd": pd_pair()}
    doc["wall_s"] = round(time.monotonic() - started, 1)
    write_result(RESULTS.stem, doc, command="bash bench/gpu_check.sh")
    pl, pd = doc["per_layer"], doc["pd"]
    print(f"{'check':<40}{'result'}")
    print(f"{'coral serve local --engine vllm':<40}identical to torch engine: {doc['serve']['identical']}, "
          f"chat: {doc['serve']['chat_identical']}, seeded repeats: {doc['serve']['seeded_repeats']}")
    print(f"{'2-rank pipeline 5,7':<40}layers {doc['pipeline']['layers_per_rank']}, "
          f"tokens identical: {doc['pipeline']['tokens_identical']}")
    for ph in DEMAND_PHASES:
        print(f"{ph + ' ms/layer (vLLM | coral)':<40}{pl['measured_ms_per_layer'][ph]:.3f} | "
              f"{pl['coral_profile_ms_per_layer'][ph]}")
    print(f"{'fused step ms/layer (vLLM | model | sum)':<40}{pl['measured_ms_per_layer']['fused']:.3f} | "
          f"{pl['fused_model_ms_per_layer']} | {pl['unfused_model_ms_per_layer']}"
          + (f"  ({pl['fused_model_error']})" if pl["fused_model_error"] else ""))
    print(f"{'PD pair via ' + pd['connector']:<40}" + (f"error: {pd['error']}" if "error" in pd else
          f"KV loaded: {pd['kv_loaded']} ({pd['decode_cached_tokens']} of {pd['prompt_tokens']} tokens), "
          f"tokens identical: {pd['tokens_identical']}"))
    print(f"wrote {RESULTS} ({doc['wall_s']} s)")


if __name__ == "__main__":
    main()
