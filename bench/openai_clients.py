"""Real benchmark clients against `coral serve local`: guidellm and aiperf stream chat completions at two
concurrencies, each loading the tiny model's exported tokenizer offline; their own TTFT, ITL and throughput.

Both clients run from the clients environment (tests/support/clients_env.py, built on first use), against one
`coral serve local` deployment (torch engine, tiny-llama, one instance of one 12-layer stage). Each request asks for
`--output-tokens` tokens with EOS ignored, and both clients count tokens from the server's usage, so every request's
output length is known in advance. Prints a table and writes bench/results/openai_clients.json.

    python -m bench.openai_clients [--concurrencies 1,4] [--requests 32] [--prompt-tokens 128] [--output-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench._args import cell, names
from bench._results import write_result

MODEL = "tiny-llama"
HEADER = ("client", "concurrency", "sent", "completed", "errors", "unfinished", "output_tokens", "ttft_ms_p50",
          "itl_ms_p50", "output_tokens_per_s", "requests_per_s")


@dataclass(frozen=True)
class Load:
    """What a client sends: `requests` streamed chats per concurrency, of `prompt_tokens` in and `output_tokens`
    out (EOS ignored)."""

    concurrencies: tuple[int, ...]
    requests: int
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Server:
    """A served deployment: its base URL (no /v1), API key, and the folder its tokenizer is loaded from."""

    url: str
    api_key: str
    tokenizer_dir: Path


def run_guidellm(env: dict[str, str], server: Server, load: Load, out: Path) -> list[dict]:
    """One guidellm run, a concurrent benchmark per concurrency; a row per concurrency."""
    report = out / "guidellm.json"
    backend = f"kind=openai_http,target={server.url},model={MODEL},api_key={server.api_key}"
    cmd = [str(Path(env["VIRTUAL_ENV"]) / "bin" / "guidellm"), "run", "--backend", backend,
           "--tokenizer", f"kind=hf_auto,model={server.tokenizer_dir}", "--profile", "kind=concurrent",
           "--override", "profile.streams", ",".join(map(str, load.concurrencies)),
           "--data", f"kind=synthetic_text,prompt_tokens={load.prompt_tokens},output_tokens={load.output_tokens}",
           "--constraint", f"kind=max_requests,count={load.requests}", "--seed", "kind=static,value=1",
           "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    _run(cmd, env, out)
    return [guidellm_row(b) for b in json.loads(report.read_text())["benchmarks"]]


def guidellm_row(bench: dict) -> dict:
    """A guidellm benchmark's figures: its scheduler's request counts (unfinished: created but not processed when
    it closed the benchmark; on a loaded machine guidellm 0.8.1 may close one while its last request streams),
    medians over completed requests, mean throughput."""
    m, state = bench["metrics"], bench["scheduler_state"]
    return {"client": "guidellm", "concurrency": bench["config"]["strategy"]["streams"],
            "sent": state["created_requests"], "completed": state["successful_requests"],
            "errors": state["errored_requests"] + state["cancelled_requests"],
            "unfinished": state["created_requests"] - state["processed_requests"],
            "output_tokens": round(m["output_token_count"]["successful"]["total_sum"]),
            "ttft_ms_p50": m["time_to_first_token_ms"]["successful"]["median"],
            "itl_ms_p50": m["inter_token_latency_ms"]["successful"]["median"],
            "output_tokens_per_s": m["output_tokens_per_second"]["successful"]["mean"],
            "requests_per_s": m["requests_per_second"]["successful"]["mean"]}


def run_aiperf(env: dict[str, str], server: Server, load: Load, out: Path) -> list[dict]:
    """One aiperf profile per concurrency; a row each."""
    # aiperf 0.13.0 in Hugging Face's offline mode looks a tokenizer up in the hub cache even when given a folder
    # (and fails); online, a folder is read as a folder, with no network call.
    env = {k: v for k, v in env.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    rows = []
    for c in load.concurrencies:
        artifacts = out / f"aiperf-c{c}"
        cmd = [str(Path(env["VIRTUAL_ENV"]) / "bin" / "aiperf"), "profile", "-m", MODEL, "--url", server.url,
               "--endpoint-type", "chat", "--streaming", "--api-key", server.api_key,
               "--tokenizer", str(server.tokenizer_dir), "--concurrency", str(c), "--request-count",
               str(load.requests), "--isl", str(load.prompt_tokens), "--osl", str(load.output_tokens),
               "--extra-inputs", "ignore_eos:true", "--use-server-token-count", "--random-seed", "1",
               "--artifact-dir", str(artifacts), "--ui", "none"]
        _run(cmd, env, out)
        rows.append(aiperf_row(json.loads((artifacts / "profile_export_aiperf.json").read_text()), c))
    return rows


def aiperf_row(doc: dict, concurrency: int) -> dict:
    """An aiperf profile's figures: its own request and error counts, medians over requests, throughput."""
    errors = sum(e.get("count", 1) for e in doc["error_summary"])
    sent, completed = round(doc["request_count"]["avg"]), round(doc["completed_request_count"]["avg"])
    return {"client": "aiperf", "concurrency": concurrency, "sent": sent, "completed": completed, "errors": errors,
            "unfinished": max(0, sent - completed - errors),
            "output_tokens": round(doc["total_output_tokens"]["avg"]),
            "ttft_ms_p50": doc["time_to_first_token"]["p50"], "itl_ms_p50": doc["inter_token_latency"]["p50"],
            "output_tokens_per_s": doc["output_token_throughput"]["avg"],
            "requests_per_s": doc["request_throughput"]["avg"]}


def _run(cmd: list[str], env: dict[str, str], out: Path) -> None:
    """Run a client, its output kept in `out`; a failure raises with the output's end."""
    done = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True, timeout=600)
    (out / f"{Path(cmd[0]).name}.log").write_text(done.stdout + done.stderr)
    if done.returncode:
        raise RuntimeError(f"{Path(cmd[0]).name} exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}")


def run_clients(env: dict[str, str], server: Server, load: Load, out: Path) -> list[dict]:
    """guidellm's rows, then aiperf's."""
    return run_guidellm(env, server, load, out) + run_aiperf(env, server, load, out)


def headline(rows: list[dict]) -> list[dict]:
    """A row per client and concurrency: its TTFT and ITL medians, output throughput, and requests completed of
    those sent with the errors it counted."""
    return [{"figure": f"{r['client']} against coral serve local, {r['concurrency']} stream(s): TTFT p50, ITL p50, "
                       "output tokens/s", "paper": None,
             "ours": f"{r['ttft_ms_p50']:.1f} ms, {r['itl_ms_p50']:.2f} ms, {r['output_tokens_per_s']:.0f} tok/s "
                     f"({r['completed']} of {r['sent']} requests, {r['errors']} errors)",
             "rule": "-", "availability": "-", "section": "openai clients"} for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrencies", default="1,4", help="comma-separated concurrent streams")
    ap.add_argument("--requests", type=int, default=32, help="requests per concurrency")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None, help="JSON file (default: bench/results/openai_clients.json)")
    args = ap.parse_args()
    from coral_dagster.runtime.hf_export import export_tiny
    from coral_dagster.runtime.local import LocalDeployment, local_instances
    from tests.support.clients_env import SPECS, build_clients_env

    load = Load(tuple(int(c) for c in names(args.concurrencies)), args.requests, args.prompt_tokens,
                args.output_tokens)
    env = build_clients_env()
    with tempfile.TemporaryDirectory(prefix="coral-clients-") as tmp, \
            LocalDeployment(MODEL, local_instances((12,), 1), log_dir=Path(tmp) / "serve", restart=False) as dep:
        dep.wait_ready(120)
        server = Server(dep.http_url, dep.api_key, export_tiny(MODEL, Path(tmp)))
        rows = run_clients(env, server, load, Path(tmp))
    print(" | ".join(HEADER))
    for r in rows:
        print(" | ".join(cell(r[k]) for k in HEADER))
    path = write_result("openai_clients", {"clients": list(SPECS), "model": MODEL, "server": "coral serve local "
                        "(torch engine, one instance of one 12-layer stage, CPU)", "load": asdict(load),
                        "cores": os.cpu_count(), "headline": headline(rows), "rows": rows}, out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
