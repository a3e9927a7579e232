"""The OpenAI clients environment: a virtualenv holding guidellm, aiperf and LiteLLM at pinned releases, cached per
spec under ~/.cache/coral/client-envs (or CORAL_CLIENT_ENV_CACHE), so a machine builds it once."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from .cached_env import cache_dir, ensure, start_background

# Releases checked with `pip index versions` on 2026-12-06 (the newest of each then).
SPECS = ("guidellm==0.8.1", "aiperf==0.13.0", "litellm==1.110.2")


def env_key() -> str:
    """What the environment is built from: the pinned specs and the Python that runs it."""
    return hashlib.sha256(json.dumps([SPECS, sys.version]).encode()).hexdigest()[:12]


def venv_dir() -> Path:
    return cache_dir("CORAL_CLIENT_ENV_CACHE", "client-envs") / f"clients-{env_key()}"


def build_clients_env() -> dict[str, str]:
    """Environment variables that run the clients' commands inside the virtualenv, building it first when it is
    missing; raises RuntimeError with pip's or Python's output when the build fails."""
    venv = venv_dir()
    # Offline: the clients read only the exported tiny model's folder, never the Hugging Face Hub.
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(venv),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    env.pop("PYTHONHOME", None)
    env.pop("PYTHONPATH", None)
    ensure(venv, lambda v: _install(v, env))
    return env


def _install(venv: Path, env: dict[str, str]) -> dict:
    """Install the specs in one pip command and import each client."""
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *SPECS],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"installing {' '.join(SPECS)} failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-4000:]}")
    # Each client imported once: a broken install fails here, and the first benchmark does not start cold.
    done = subprocess.run([str(venv / "bin" / "python"), "-c", "import aiperf, guidellm, litellm, transformers"],
                          env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"the clients environment does not import:\n{done.stderr[-4000:]}")
    return {"specs": SPECS}


def start_background_build() -> subprocess.Popen | None:
    """Build the clients environment in the background (`cached_env.start_background`)."""
    return start_background(venv_dir(), "clients_env", "build_clients_env")
