"""Running the vLLM CPU node environment from tests: a script in it, `coral serve local --engine vllm`, HTTP calls
with the test's API key, and stopping or naming what vLLM started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import pytest

from coral_dagster import paths
from coral_dagster.runtime.groups import kill_group

# A small memory share (CPU memory there).
SMALL = ["--gpu-memory-utilization", "0.05", "--max-model-len", "512"]
ROOT = paths.REPO_ROOT


def node_python(env: dict[str, str], code: str, timeout: float = 600):
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


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL it if vLLM's shutdown takes longer than 30 s."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


API_KEY = "vllm-test-key"
HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), HEADERS)
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def stream(url: str, body: dict) -> list[int]:
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(), HEADERS)
    tokens = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    tokens += choice.get("token_ids") or []
    return tokens


def serve_local_vllm(env: dict[str, str], log_dir: Path, port: int,
                      layout: tuple[str, ...] = ("--instances", "1")) -> tuple[subprocess.Popen, dict]:
    """`coral serve local --engine vllm` with one instance (or `layout`), and its ready line."""
    proc = subprocess.Popen(
        [str(Path(env["VIRTUAL_ENV"]) / "bin" / "coral"), "serve", "local", "--engine", "vllm", "--model",
         "tiny-llama", *layout, "--port", str(port), "--json", "--ready-timeout-s", "400", "--api-key", API_KEY,
         "--log-dir", str(log_dir), "--vllm-args", " ".join(SMALL)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    ready = json.loads(proc.stdout.readline() or "{}")
    if not ready.get("ready"):
        stop(proc)
        pytest.fail(f"serve local did not start: {ready}; " + "".join(
            f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in log_dir.glob("*.log")))
    return proc, ready


def names(pids: set[int]) -> set[str]:
    """Process names (vLLM titles its own: VLLM::EngineCore, VLLM::Worker) of those still running."""
    names = set()
    for pid in pids:
        try:
            names.add(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode().strip())
        except OSError:
            pass
    return names
