"""The OpenAI clients environment: a virtualenv holding guidellm, aiperf and LiteLLM at pinned releases, cached per
spec under ~/.cache/coral/client-envs (or CORAL_CLIENT_ENV_CACHE), so a machine builds it once."""

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

# Releases checked with `pip index versions` on 2026-12-06 (the newest of each then).
SPECS = ("guidellm==0.8.1", "aiperf==0.13.0", "litellm==1.110.2")


def _cache() -> Path:
    return Path(os.environ.get("CORAL_CLIENT_ENV_CACHE") or Path.home() / ".cache" / "coral" / "client-envs")


def env_key() -> str:
    """What the environment is built from: the pinned specs and the Python that runs it."""
    return hashlib.sha256(json.dumps([SPECS, sys.version]).encode()).hexdigest()[:12]


def venv_dir() -> Path:
    return _cache() / f"clients-{env_key()}"


def build_clients_env() -> dict[str, str]:
    """Environment variables that run the clients' commands inside the virtualenv, building it first when it is
    missing; raises RuntimeError with pip's or Python's output when the build fails."""
    venv = venv_dir()
    # Offline: the clients read only the exported tiny model's folder, never the Hugging Face Hub.
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(venv),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    env.pop("PYTHONHOME", None)
    env.pop("PYTHONPATH", None)
    if (venv / "ready.json").is_file():
        return env
    _cache().mkdir(parents=True, exist_ok=True)
    # One build per machine: test processes running side by side (pytest -n) wait for the one building.
    with open(_cache() / f"clients-{env_key()}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / "ready.json").is_file():
            _build(venv, env)
    return env


def _build(venv: Path, env: dict[str, str]) -> None:
    """Create the virtualenv, install the specs in one pip command and import each client; ready.json marks it
    complete."""
    shutil.rmtree(venv, ignore_errors=True)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
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
    (venv / "ready.json").write_text(json.dumps({"specs": SPECS, "build_s": round(time.monotonic() - started, 1)}))


def start_background_build() -> subprocess.Popen | None:
    """Build the clients environment in a child process of its own group (None when it is built already), so the
    build overlaps the tests that run before the ones needing it."""
    if (venv_dir() / "ready.json").is_file():
        return None
    code = "from support.clients_env import build_clients_env; build_clients_env()"
    return subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
