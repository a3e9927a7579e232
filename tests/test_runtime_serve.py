"""End to end: `coral serve local` processes answer over HTTP exactly as single-process `coral generate` does."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest

from coral_dagster.runtime.local import free_port

pytest.importorskip("torch")

from support.serve_reference import MAX_TOKENS, PROMPTS, reference  # noqa: E402
from support.runtime_procs import kill_all, remember  # noqa: E402

FAST = ["--heartbeat-s", "0.2", "--dead-after-s", "1.5"]


def http(url: str, body: dict | None = None, timeout_s: float = 30.0, key: str | None = None):
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    return urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=timeout_s)


def api_key(info: dict) -> str:
    """The key `serve local` generated, read from the file it named (owner-only)."""
    path = info["api_key_file"]
    assert os.stat(path).st_mode & 0o077 == 0
    with open(path) as f:
        return f.read().strip()


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        raise TimeoutError(f"`serve local` printed nothing within {timeout_s} s")
    return proc.stdout.readline().decode()


@contextmanager
def serve_local(log_dir, *args: str):
    """Run `coral serve local … --json` until its ready line; always end it and every child it started."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "coral_dagster.cli.serve", "local", "--model", "tiny-llama",
                             "--port", str(port), "--json", "--log-dir", str(log_dir), *FAST, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    info: dict = {}
    try:
        line = _read_line(proc, 60)
        info = json.loads(line)
        remember(info.get("pids", {}).values())
        assert info["ready"] and info["http"] == f"http://127.0.0.1:{port}"
        yield info
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        kill_all(info.get("pids", {}).values())


@pytest.mark.parametrize("extra", [[], ["--pd"]], ids=["aggregated", "pd-handoff"])
def test_serve_local_matches_generate_token_for_token(extra, tmp_path):
    expected = [reference(p) for p in PROMPTS]
    with serve_local(tmp_path, "--split", "3,5,4", "--instances", "2", *extra) as info:
        key = api_key(info)
        names = {i["instance"] for i in info["instances"]}
        assert names == ({"prefill-0", "decode-0"} if extra else {"agg-0", "agg-1"})
        assert len(info["pids"]) == 2 + 2 * (1 + 3)  # coordinator, its standby + 2 × (scheduler + 3 stage nodes)
        models = json.load(http(info["http"] + "/v1/models", key=key))
        assert [m["id"] for m in models["data"]] == ["tiny-llama"]

        body = json.load(http(info["http"] + "/v1/completions",
                              {"model": "tiny-llama", "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0},
                              key=key))
        got = sorted(body["choices"], key=lambda c: c["index"])
        assert [c["token_ids"] for c in got] == [e["tokens"] for e in expected]
        assert [c["text"] for c in got] == [e["text"] for e in expected]
        assert [c["finish_reason"] for c in got] == [e["finish_reason"] for e in expected]
        assert body["usage"]["completion_tokens"] == sum(len(e["tokens"]) for e in expected)

        with http(info["http"] + "/v1/completions", {"model": "tiny-llama", "prompt": PROMPTS[1],
                                                     "max_tokens": MAX_TOKENS, "stream": True}, key=key) as resp:
            assert resp.headers["Content-Type"] == "text/event-stream"
            events = [line[6:].strip() for line in resp.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        assert "".join(c["text"] for c in chunks) == expected[1]["text"]
        assert [c["finish_reason"] for c in chunks][-1] == expected[1]["finish_reason"]

        for bad, code, words in (({"model": "other", "prompt": "x"}, 404, "one of: tiny-llama"),
                                 ({"model": "tiny-llama", "prompt": "x", "presence_penalty": 2.5}, 400,
                                  "presence_penalty"),
                                 ({"model": "tiny-llama", "prompt": 5}, 400, "prompt")):
            with pytest.raises(urllib.error.HTTPError) as err:
                http(info["http"] + "/v1/completions", bad, key=key)
            assert err.value.code == code and words in json.load(err.value)["error"]["message"]

        status = json.load(http(info["http"] + "/admin/instances", key=key))
        served = {i["instance"]: i["served"] for i in status["instances"]}
        # Five requests served (the unknown model never reached an instance); aggregated instances share them
        # by round-robin, PD sends each through both phases.
        assert served == ({"prefill-0": 5, "decode-0": 5} if extra else {"agg-0": 3, "agg-1": 2} if
                          served["agg-0"] >= served["agg-1"] else {"agg-0": 2, "agg-1": 3})


def test_roles_run_from_env_vars_with_curve_as_skypilot_would_start_them():
    """Each role as its own `coral serve <role>`, configured only by CORAL_* variables carrying CURVE secrets."""
    from coral_dagster.runtime.client import Client
    from coral_dagster.runtime.security import CurveKeys

    keys = CurveKeys.generate()
    coordinator, scheduler = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    base = {**os.environ, **keys.env(), "CORAL_MODEL": "tiny-llama", "CORAL_HEARTBEAT_S": "0.2",
            "CORAL_DEAD_AFTER_S": "1.5", "OMP_NUM_THREADS": "1"}
    roles = [("coordinator", {"CORAL_LISTEN": coordinator, "CORAL_HTTP_PORT": "-1"}),
             ("scheduler", {"CORAL_INSTANCE": "solo", "CORAL_SPLIT": "5,7", "CORAL_COORDINATOR": coordinator,
                            "CORAL_LISTEN": scheduler}),
             ("engine", {"CORAL_NODE": "solo-0", "CORAL_LAYERS": "0:5", "CORAL_STAGE_RANK": "0",
                         "CORAL_SCHEDULER": scheduler}),
             ("engine", {"CORAL_NODE": "solo-1", "CORAL_LAYERS": "5:12", "CORAL_STAGE_RANK": "1",
                         "CORAL_SCHEDULER": scheduler})]
    procs = []
    try:
        for role, env in roles:
            procs.append(subprocess.Popen([sys.executable, "-m", "coral_dagster.cli.serve", role],
                                          env={**base, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        with Client(coordinator, keys=keys, timeout_s=30) as c:
            c.wait_ready(1, timeout_s=60)
            done = c.complete("tiny-llama", [PROMPTS[0]], max_tokens=MAX_TOKENS)[0]
        assert done["tokens"] == reference(PROMPTS[0])["tokens"]

        plain = {k: v for k, v in base.items() if not k.startswith("CORAL_CURVE")}
        refused = subprocess.run([sys.executable, "-m", "coral_dagster.cli.serve", "coordinator", "--listen",
                                  f"tcp://0.0.0.0:{free_port()}", "--http-port", "-1"], env=plain,
                                 capture_output=True, timeout=60)
        assert refused.returncode == 2 and b"CORAL_CURVE_SECRET_KEY" in refused.stderr
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
