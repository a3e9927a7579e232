"""The CLI reference (docs/cli.md), rendered from every command's own `--help`."""

from __future__ import annotations

import sys
from pathlib import Path

import click

HEADER = """# CLI reference

Generated from the commands' own `--help` by `python -m coral_dagster.cli.reference --write`;
`tests/test_cli_reference.py` fails when this page is not what the commands print.
"""


def _commands(group: click.Group, ctx: click.Context, path: tuple[str, ...]):
    """Every command under `group`, depth first in name order, with the context its help renders in."""
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if cmd is None or cmd.hidden:
            continue
        sub = click.Context(cmd, info_name=name, parent=ctx, terminal_width=100, max_content_width=100)
        yield (*path, name), cmd, sub
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, sub, (*path, name))


def render() -> str:
    """docs/cli.md as the installed commands describe themselves."""
    from coral_dagster.cli.main import main

    # As `coral` itself makes its context (its `-h` alias included), so the page reads the same in any process.
    root = click.Context(main, info_name="coral", terminal_width=100, max_content_width=100,
                         **main.context_settings)
    parts = [HEADER, "## coral\n", "```text\n" + main.get_help(root).rstrip() + "\n```\n"]
    for path, cmd, ctx in _commands(main, root, ()):
        parts.append(f"{'#' * min(len(path) + 2, 4)} coral {' '.join(path)}\n")
        parts.append("```text\n" + cmd.get_help(ctx).rstrip() + "\n```\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Print the reference, or with `--write` write it to docs/cli.md."""
    from coral_dagster.app.documents import REPO_ROOT

    text = render()
    if "--write" in (argv if argv is not None else sys.argv[1:]):
        Path(REPO_ROOT / "docs" / "cli.md").write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
