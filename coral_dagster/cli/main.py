"""The `coral` command: one group, each area's commands registered from its own module."""

from __future__ import annotations

import importlib
import logging
import sys

import click

from coral_dagster.errors import CoralError
from coral_dagster.app.processes import stop_on_sigterm

# name -> module:attribute; imported on use, so a GPU node with only the runtime installed runs `coral serve`.
COMMANDS = {
    "catalog": "catalog:cli", "run": "run:cli", "profile": "profile:cli", "templates": "templates:cli",
    "plan": "plan:plan", "bench": "plan:bench", "launch": "launch:launch", "down": "down:down",
    "serve": "serve:serve", "generate": "serve:generate", "simulate": "simulate:cli", "status": "launch:status",
    "day": "day:cli",
}


class _Coral(click.Group):
    """A click group that loads each command's module on use and turns `CoralError` into one readable line and
    exit status 2."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr = COMMANDS[name].split(":")
        try:
            return getattr(importlib.import_module(f"coral_dagster.cli.{module}"), attr)
        except ModuleNotFoundError as exc:
            return _missing(name, exc.name or "a dependency")

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except CoralError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)


def _missing(name: str, package: str) -> click.Command:
    """Stands for a command whose libraries this environment lacks (a GPU node has the runtime only)."""
    def run(**_: object) -> None:
        raise CoralError(f"`coral {name}` needs {package}, which this environment does not have.",
                         "install the planner: pip install 'coral-dagster[planner]'")

    return click.Command(name, callback=run, help=f"(unavailable here: needs {package})",
                         context_settings={"ignore_unknown_options": True, "allow_extra_args": True})


@click.group(cls=_Coral, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Log what each step does.")
def main(verbose: bool) -> None:
    """Coral plans and serves many LLMs at the lowest cost on mixed cloud GPUs.

    Typical flow: `coral run` (the whole pipeline on the bundled data), or step by step:
    `coral catalog load`, `coral profile …`, `coral templates build`, `coral plan`, `coral simulate`,
    `coral launch --dry-run`. Every command takes --help and --json.
    """
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # `timeout` and `kill` end a command as Ctrl-C does: its worker pools are terminated, its store closed.
    stop_on_sigterm()


if __name__ == "__main__":
    main()
