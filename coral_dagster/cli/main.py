"""The `coral` command: one group, each area's commands registered from its own module."""

from __future__ import annotations

import logging
import sys

import click

from coral_dagster.cli import catalog, launch, plan, profile, run, serve, simulate, templates
from coral_dagster.errors import CoralError


class _Coral(click.Group):
    """A click group that turns `CoralError` into one readable line and exit status 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except CoralError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)


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


main.add_command(catalog.cli, "catalog")
main.add_command(run.cli, "run")
main.add_command(profile.cli, "profile")
main.add_command(templates.cli, "templates")
main.add_command(plan.plan, "plan")
main.add_command(plan.bench, "bench")
main.add_command(launch.launch, "launch")
main.add_command(serve.serve, "serve")
main.add_command(serve.generate, "generate")
main.add_command(simulate.cli, "simulate")
main.add_command(launch.status, "status")
