"""Where a bench's figures go: one JSON per result under bench/results/, stamped with the command, date and code."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from coral_dagster.files import make_dir, write_file

RESULTS = Path(__file__).resolve().parent / "results"


def provenance(command: str | None = None) -> dict:
    """The command that made a result (default: this process's), when (UTC date) and at which commit."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True,
                                cwd=RESULTS.parent, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    argv = " ".join(sys.argv[1:])
    return {"command": command or f"python -m {_module()} {argv}".strip(),
            "date": datetime.now(timezone.utc).date().isoformat(), "commit": commit}


def _module() -> str:
    """The running bench as `bench.<name>`."""
    return f"bench.{Path(sys.argv[0]).stem}"


def write_result(name: str, doc: dict, command: str | None = None, out: Path | None = None) -> Path:
    """Write `doc` with its provenance under `meta` to bench/results/<name>.json (or `out`; mode 0644, no symbolic
    link followed, as `coral_dagster.files` writes); the path written.

    A doc may carry `headline`: rows of {figure, paper, ours, rule, availability, section} that `bench.report`
    renders into BENCHMARKS.md's headline table."""
    path = out or RESULTS / f"{name}.json"
    make_dir(path.parent, "pass another --out path")
    return write_file(path, json.dumps({"meta": provenance(command), **doc}, indent=2, default=str) + "\n",
                      fix="pass another --out path")
