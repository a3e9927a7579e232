"""Virtualenvs the tests build once per machine: each under a cache folder, named by a digest of what it is built
from, built under a file lock (test processes running side by side wait for the one building), marked complete by
`ready.json`, and buildable in the background while other tests run."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def cache_dir(variable: str, name: str) -> Path:
    """`$variable`, else ~/.cache/coral/<name>."""
    return Path(os.environ.get(variable) or Path.home() / ".cache" / "coral" / name)


def ensure(venv: Path, build: Callable[[Path], dict]) -> None:
    """Create the virtualenv `venv` and fill it with `build(venv)` unless `ready.json` says it is complete; `build`
    raises RuntimeError with its output when it fails, and returns what `ready.json` records beside the build
    time."""
    if (venv / "ready.json").is_file():
        return
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (venv / "ready.json").is_file():
            return
        shutil.rmtree(venv, ignore_errors=True)
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        record = build(venv)
        (venv / "ready.json").write_text(json.dumps({**record, "build_s": round(time.monotonic() - started, 1)}))


def start_background(venv: Path, module: str, function: str) -> subprocess.Popen | None:
    """Run `support.<module>.<function>()` (which builds `venv`) in a child process of its own group, None when
    `venv` is complete already, so the build overlaps the tests that run before the ones needing it."""
    if (venv / "ready.json").is_file():
        return None
    code = f"from support.{module} import {function}; {function}()"
    return subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
