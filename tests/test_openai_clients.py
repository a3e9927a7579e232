"""Real benchmark and agent clients against `coral serve local` (torch engine, tiny-llama): the tiny model's exported
tokenizer loads offline in transformers and tokenizes as the byte tokenizer; guidellm and aiperf stream a short
benchmark at two concurrencies with no errors; LiteLLM's OpenAI provider completes a chat and a tool call. The
oracles: the byte tokenizer and the server's /detokenize rule on random text and ids, the clients' own request and
token counts against what was sent, and the official `openai` client's answer to the same request."""

from __future__ import annotations

import json
import random
import subprocess
import time
from pathlib import Path

import jsonschema
import openai
import pytest

from bench.openai_clients import Load, Server, run_aiperf, run_guidellm
from coral_dagster.runtime.frontdoor import _detokenize
from coral_dagster.runtime.hf_export import export_tiny
from coral_dagster.runtime.local import LocalDeployment, local_instances
from coral_dagster.runtime.tokenizer import BOS, EOS, ByteTokenizer
from support.openai_stack import scrape

MODEL = "tiny-llama"
LOAD = Load(concurrencies=(1, 4), requests=8, prompt_tokens=32, output_tokens=16)
# Code points from ASCII (controls included), Latin-1, Greek, CJK, combining marks and emoji: 1 to 4 UTF-8 bytes.
RANGES = [(0x0, 0x7F), (0xA0, 0xFF), (0x391, 0x3C9), (0x4E00, 0x4EFF), (0x300, 0x36F), (0x1F600, 0x1F64F)]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}]
CHAT = [{"role": "user", "content": "Tell me about coral reefs."}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# LiteLLM's OpenAI provider, run in the clients environment: the chat, a required call, a named call.
LITELLM = """
import json, sys
import litellm
url, key, chat, ask, tools = sys.argv[1], sys.argv[2], *map(json.loads, sys.argv[3:])
kw = dict(model="openai/tiny-llama", api_base=url, api_key=key, temperature=0, max_tokens=16)
said = litellm.completion(messages=chat, **kw).choices[0]
named = {"type": "function", "function": {"name": "get_weather"}}
calls = [litellm.completion(messages=ask, tools=tools, tool_choice=choice, parallel_tool_calls=False,
                            **{**kw, "max_tokens": 120}).choices[0] for choice in ("required", named)]
print(json.dumps({"text": said.message.content, "finish": said.finish_reason,
                  "calls": [[{"name": t.function.name, "arguments": t.function.arguments}
                             for t in c.message.tool_calls or []] for c in calls]}))
"""


def _random_text(rng: random.Random) -> str:
    return "".join(chr(rng.randint(*rng.choice(RANGES))) for _ in range(rng.randint(0, 40)))


def test_the_exported_tokenizer_loads_offline_and_tokenizes_as_the_byte_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(export_tiny(MODEL, tmp_path), local_files_only=True)
    byte = ByteTokenizer()
    assert (tok.bos_token_id, tok.eos_token_id, len(tok)) == (BOS, EOS, byte.vocab)
    rng = random.Random(7)
    for _ in range(300):
        text = _random_text(rng)
        ids = byte.encode(text)
        assert tok.encode(text) == ids
        assert tok.decode(ids, skip_special_tokens=True) == text
    # Any other ids, invalid UTF-8 runs and the ids beyond the bytes included: the text /detokenize answers. (Not
    # BOS or EOS inside a byte run: Hugging Face drops them and joins the bytes around them, /detokenize does not.)
    others = [t for t in range(byte.vocab) if t not in (BOS, EOS)]
    for _ in range(300):
        ids = [rng.choice((rng.choice(others), rng.randrange(0x80, 0x100))) for _ in range(rng.randint(0, 30))]
        assert tok.decode([BOS, *ids, EOS], skip_special_tokens=True) == _detokenize(byte, ids)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`coral serve local`'s deployment: one instance of one 12-layer torch stage, and the exported tokenizer."""
    tmp = tmp_path_factory.mktemp("clients")
    with LocalDeployment(MODEL, local_instances((12,), 1), log_dir=tmp / "serve", restart=False) as dep:
        dep.wait_ready(120)
        yield Server(dep.http_url, dep.api_key, export_tiny(MODEL, tmp))


@pytest.mark.slow
@pytest.mark.parametrize("run", [run_guidellm, run_aiperf], ids=["guidellm", "aiperf"])
def test_a_benchmark_client_streams_every_request_without_errors(run, served, clients_env, tmp_path):
    """The client sends every request and counts no error; the server finished each at its length (its own
    counters, vLLM's `request_success` and `generation_tokens`), and each the client saw end streamed exactly the
    tokens asked for. A request the client still held open when it closed its benchmark (guidellm's scheduler, on
    a loaded machine) is counted unfinished by the client, never an error, and finished by the server."""
    before = scrape(served.url)
    rows = run(clients_env, served, LOAD, tmp_path)
    assert [r["concurrency"] for r in rows] == list(LOAD.concurrencies)
    for r in rows:
        assert (r["sent"], r["errors"], r["completed"] + r["unfinished"]) == (LOAD.requests, 0, LOAD.requests), r
        # EOS ignored: every request streamed exactly the tokens asked for, as the client counted them.
        assert r["output_tokens"] == r["completed"] * LOAD.output_tokens, r
        assert min(r["ttft_ms_p50"], r["itl_ms_p50"], r["output_tokens_per_s"], r["requests_per_s"]) > 0, r
    sent = len(LOAD.concurrencies) * LOAD.requests

    def grew(name: str, **labels) -> float:
        key = (name, tuple(sorted({"model_name": MODEL, **labels}.items())))
        return scrape(served.url).get(key, 0) - before.get(key, 0)

    deadline = time.monotonic() + 30
    while grew("vllm:request_success_total", finished_reason="length") < sent and time.monotonic() < deadline:
        time.sleep(0.2)
    assert grew("vllm:request_success_total", finished_reason="length") == sent
    assert grew("vllm:request_success_total", finished_reason="abort") == 0
    assert grew("vllm:generation_tokens_total") == sent * LOAD.output_tokens


@pytest.mark.slow
def test_litellm_completes_a_chat_and_tool_calls_as_the_official_client_does(served, clients_env):
    done = subprocess.run([str(Path(clients_env["VIRTUAL_ENV"]) / "bin" / "python"), "-c", LITELLM,
                           f"{served.url}/v1", served.api_key, *map(json.dumps, (CHAT, ASK, TOOLS))],
                          env=clients_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout)
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=served.api_key, max_retries=0, timeout=60)
    want = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=16).choices[0]
    assert (got["text"], got["finish"]) == (want.message.content, want.finish_reason) and got["text"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for call, choice in zip(got["calls"], ("required", named), strict=True):
        ref = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                             parallel_tool_calls=False, temperature=0, max_tokens=120).choices[0]
        assert call
        for t in call:
            assert t["name"] == "get_weather"
            jsonschema.validate(json.loads(t["arguments"]), WEATHER)
        assert call == [{"name": t.function.name, "arguments": t.function.arguments} for t in ref.message.tool_calls]

