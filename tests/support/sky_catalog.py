"""SkyPilot's catalog from the bundled price CSVs, and SkyPilot code run in a child process against it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

from coral_dagster import paths


def _catalog(home: Path) -> None:
    """The bundled CSVs as SkyPilot's v8 catalog, plus its accelerator-name table for the names they use."""
    root = home / ".sky" / "catalogs" / "v8"
    clouds: dict[str, set[str]] = {}
    for cloud, name in (("aws", "aws_gpu_vms.csv"), ("gcp", "gcp_gpu_vms.csv")):
        (root / cloud).mkdir(parents=True)
        text = (paths.PRICES_DIR / name).read_text()
        (root / cloud / "vms.csv").write_text(text)
        for acc in pd.read_csv(paths.PRICES_DIR / name).AcceleratorName.dropna().unique():
            clouds.setdefault(acc, set()).add(cloud.upper())
    (root / "common").mkdir()
    pd.DataFrame({"AcceleratorName": sorted(clouds), "Clouds": [str(sorted(clouds[a])) for a in sorted(clouds)]}
                 ).to_csv(root / "common" / "accelerators.csv", index=False)


def run_sky(code: str, payload: dict, home: Path) -> subprocess.CompletedProcess:
    """`code` in a child Python reading `payload` as JSON on stdin, with HOME at `home` (its SkyPilot catalog)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKYPILOT")}
    env.pop("SKY_RUNTIME_DIR", None)
    env["HOME"] = str(home)
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(payload), capture_output=True, text=True,
                          cwd=paths.REPO_ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-8000:]
    return done
