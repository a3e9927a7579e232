"""ruff and mypy, as configured in pyproject.toml (with its dated baselines), pass on the package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> str:
    path = Path(sys.executable).with_name(name)
    if not path.exists():
        pytest.skip(f"{name} is not installed (it is in the dev extra)")
    return str(path)


def test_ruff_is_clean_on_the_package_and_its_tests():
    out = subprocess.run([_tool("ruff"), "check", "coral_dagster", "assets", "resources", "bench", "tests"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_mypy_is_clean_on_the_package():
    out = subprocess.run([_tool("mypy")], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout + out.stderr
