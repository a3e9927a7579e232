"""docs/cli.md is what the commands' own `--help` prints, and it names every command."""

from __future__ import annotations

from coral_dagster import paths
from coral_dagster.cli.main import COMMANDS
from coral_dagster.cli.reference import render


def test_cli_reference_is_the_commands_own_help():
    page = (paths.REPO_ROOT / "docs" / "cli.md").read_text()
    assert page == render(), "docs/cli.md is stale: run python -m coral_dagster.cli.reference --write"
    for name in COMMANDS:
        assert f"\n### coral {name}\n" in page, name
