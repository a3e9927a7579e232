"""docs/cli.md is what the commands' own `--help` prints, and it names every command."""

from __future__ import annotations

import subprocess
import sys

from coral_dagster import paths
from coral_dagster.cli.main import COMMANDS


def test_cli_reference_is_the_commands_own_help():
    # Rendered in a process of its own, as a user's `coral … --help` is: click caches each command's help option
    # the first time any context uses it, so a render in this process would depend on which tests ran before.
    rendered = subprocess.run([sys.executable, "-m", "coral_dagster.cli.reference"], cwd=paths.REPO_ROOT,
                              capture_output=True, text=True, timeout=300, check=True).stdout
    page = (paths.REPO_ROOT / "docs" / "cli.md").read_text()
    assert page == rendered, "docs/cli.md is stale: run python -m coral_dagster.cli.reference --write"
    for name in COMMANDS:
        assert f"\n### coral {name}\n" in page, name
