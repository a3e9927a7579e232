"""`coral down`: drain and take down every cluster `coral launch` started, from the recorded deployment."""

from __future__ import annotations

import click

from coral_dagster.cli._out import NON_NEGATIVE, db_option, emit_json, json_option


@click.command("down")
@click.option("--dry-run", is_flag=True, help="Print the drain and `sky down` steps; take nothing down.")
@click.option("--drain-timeout", "drain_timeout_s", type=NON_NEGATIVE, default=600.0, show_default=True,
              help="Seconds each instance may take to finish its in-flight requests before `sky down`.")
@json_option
@db_option
def down(dry_run: bool, drain_timeout_s: float, as_json: bool, db_path: str | None) -> None:
    """Take the whole recorded deployment down: each instance drained through the coordinator, then every
    cluster `sky down`, the coordinator last. The state in DuckDB records each step (`coral status --all`)."""
    from coral_dagster.app.teardown import take_down, teardown_steps

    if dry_run:
        clusters, steps = teardown_steps(db_path)
        if as_json:
            emit_json({"dry_run": True, "clusters": clusters, "commands": steps})
        else:
            click.echo("\n".join(steps) if steps else "nothing recorded as up")
        return
    report = take_down(db_path, drain_timeout_s)
    if as_json:
        emit_json(report.as_dict())
        return
    click.echo(f"run {report.run_id} ({report.status}): {len(report.drained)} drained, {len(report.downed)} down")
    for message in report.messages:
        click.echo(f"  {message}")
