"""`coral launch` and `coral status`: run a plan on SkyPilot (or show what that would do) and show the deployment."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pandas as pd

from coral_dagster.vocab import METHODS
from coral_dagster.cli._out import NON_NEGATIVE, db_option, emit, emit_json, json_option
from coral_dagster.cli.types import prices_path_option
from coral_dagster.app.deployment import GPU_ROLES


def _records(df: pd.DataFrame) -> list[dict]:
    """A frame as JSON-ready records (NaN becomes null, numpy numbers plain numbers)."""
    return json.loads(df.to_json(orient="records", date_format="iso"))


def _load_plan(store, ref: str, scenario: str, method: str, prices=None):
    """The plan to deploy: `latest` of the scenario and method, a stored plan id, or a plan file with a plan_id
    (its regions and nodes checked against the price table `prices`)."""
    from coral_dagster.app.plans import resolve_plan

    return resolve_plan(store, ref, scenario, method, prices)


def _actions(diff) -> pd.DataFrame:
    """One row per cluster the run would touch."""
    rows = [{"action": "launch", "cluster": n.cluster_name, "role": n.role, "instance": n.instance_id,
             "region": n.region, "node": n.node or None, "instance_type": n.instance_type or None,
             "spot": n.use_spot if n.role in GPU_ROLES else None,
             "usd_per_hour": n.usd_per_hour} for n in diff.nodes_to_launch()]
    rows += [{"action": "drain+down", "cluster": c, "role": None, "instance": r.instance_id, "region": None,
              "node": None, "instance_type": None, "spot": None, "usd_per_hour": None}
             for r in diff.remove for c in r.clusters]
    return pd.DataFrame(rows, columns=["action", "cluster", "role", "instance", "region", "node", "instance_type",
                                       "spot", "usd_per_hour"])


def _echo_cost(plan, cost, priced_from: str) -> None:
    """The deployment's full cost beside the plan's, and each part left unpriced."""
    click.echo(f"deployment ${cost.total_usd_per_hour:,.2f}/h = ${cost.gpu_usd_per_hour:,.2f}/h for "
               f"{cost.gpu_nodes} GPU node(s) + ${cost.cpu_usd_per_hour:,.2f}/h for {cost.cpu_nodes} CPU VM(s), "
               f"priced from {priced_from}; plan ${plan.cost_usd_per_hour:,.2f}/h")
    for part in cost.unpriced:
        click.echo(f"  {part}")


@click.command("launch")
@click.option("--plan", "plan_ref", default="latest", show_default=True,
              help="'latest' (the scenario's newest plan of --method), a plan id (see `coral plan --json`), or a "
                   "plan JSON file as `coral plan --json` prints it (deployed under its plan_id only when it is "
                   "that stored plan unchanged, else as file-<content hash>).")
@click.option("--scenario", default="core", show_default=True, help="Scenario whose plan `latest` means.")
@click.option("--method", type=click.Choice(METHODS), default="coral", show_default=True,
              help="Method whose plan `latest` means.")
@click.option("--dry-run", is_flag=True,
              help="Write the task YAMLs and print the sky launch / sky down commands; launch nothing.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Folder for the dry run's task YAMLs (default: out/deploy/<plan tag>).")
@click.option("--drain-timeout", "drain_timeout_s", type=NON_NEGATIVE, default=600.0, show_default=True,
              help="Seconds a removed instance may take to finish its in-flight requests before `sky down`.")
@click.option("--retry-until-up", is_flag=True,
              help="Let SkyPilot keep retrying a node when its region has no capacity (default: fail and roll back).")
@click.option("--plain-http", is_flag=True,
              help="Serve clients plain HTTP (default: HTTPS, with a self-signed certificate made on each coordinator "
                   "VM unless CORAL_TLS_CERTFILE/KEYFILE name a real one; docs/deployment.md).")
@prices_path_option
@json_option
@db_option
def launch(plan_ref: str, scenario: str, method: str, dry_run: bool, out_dir: str | None, drain_timeout_s: float,
           retry_until_up: bool, plain_http: bool, prices_path: str | None, as_json: bool, db_path: str | None) -> None:
    """Reconcile the running deployment to a plan: launch added instances, drain and take down removed ones.

    Each GPU node is its own SkyPilot cluster (accelerators, cloud, region, spot as planned); an instance's first
    node also runs its scheduler, and the others are wired to it through envs; two CPU VMs run the coordinator
    pair (a primary, and a standby that serves when the primary stops answering; every scheduler knows both).
    The deployment's full cost (GPU nodes, CPU VMs, unpriced parts such as disks) is shown beside the plan's.
    State lives in DuckDB (`coral status`); a run that stops part-way is resumed by the next one. Secrets (HF_TOKEN,
    CORAL_CURVE_SECRET_KEY, CORAL_CURVE_PUBLIC_KEYS, CORAL_REGISTRATION_KEY, CORAL_API_KEY) are read from this shell
    at launch and handed to SkyPilot as secrets, never written anywhere; each instance gets its own
    CORAL_INSTANCE_CREDENTIAL, derived from CORAL_REGISTRATION_KEY, which only the coordinators receive. The
    primary coordinator's OpenAI URL (HTTPS unless --plain-http) is printed at the end (and by `coral status`);
    clients send CORAL_API_KEY as their api_key. --dry-run writes one task YAML per cluster kind and `launch.sh`,
    which launches every cluster from them in order, and shows the URL. A real run needs the `cloud` extra and
    cloud credentials (`sky check`); SkyPilot starts its local API
    server itself.
    """
    from coral_dagster.app.deployment import deploy
    from coral_dagster.app.plans import plan_label
    from coral_dagster.app.plans import Store
    from coral_dagster.app.prices import price_table

    store = Store(db_path)
    prices = price_table(prices_path)
    plan = _load_plan(store, plan_ref, scenario, method, prices)
    label = plan_label(plan)
    done = deploy(store, plan, dry_run=dry_run, out=Path(out_dir) if out_dir else None,
                  drain_timeout_s=drain_timeout_s, retry_until_up=retry_until_up, plain_http=plain_http,
                  prices=prices)
    report = done.report
    if report is not None:
        if as_json:
            emit_json(done.as_dict())
            return
        _echo_cost(plan, done.cost, done.priced_from)
        click.echo(f"run {report.run_id} ({report.status}): {len(report.launched)} launched, {len(report.failed)} "
                   f"failed, {len(report.drained)} drained, {len(report.downed)} down, {len(report.kept)} kept")
        for message in report.messages:
            click.echo(f"  {message}")
        _echo_endpoint(done.url)
        return
    diff, dry = done.diff, done.dry
    assert diff is not None and dry is not None  # a dry run's
    actions = _actions(diff)
    if as_json:
        emit_json({**done.as_dict(), "actions": _records(actions), "endpoint": dry.endpoint,
                   "coordinators": list(dry.coordinators)})
        return
    _echo_cost(plan, done.cost, done.priced_from)
    if not diff.changes:
        click.echo(f"{label}: nothing to change ({len(diff.keep)} instance(s) running as planned)")
        return
    emit(actions, False, title=f"{label}: launch {len(actions[actions.action == 'launch'])} cluster(s), "
                               f"remove {len(diff.remove)} and keep {len(diff.keep)} instance(s)")
    click.echo(f"# {len(dry.yaml_paths)} task YAML(s), one per cluster kind, in {done.out}; run {dry.script}:")
    for line in dry.commands:
        click.echo(line)
    _echo_endpoint(dry.endpoint)


def _echo_endpoint(url: str | None) -> None:
    if url:
        click.echo(f"OpenAI API: {url} (clients send $CORAL_API_KEY as their api_key)")


@click.command("status")
@click.option("--all", "show_all", is_flag=True, help="Also list clusters that are down or failed (history).")
@json_option
@db_option
def status(show_all: bool, as_json: bool, db_path: str | None) -> None:
    """Show the deployment recorded in DuckDB: live clusters, their status, address and price."""
    from coral_dagster.app.deployment import endpoint
    from coral_dagster.app.deployment import state
    from coral_dagster.app.plans import Store

    store = Store(db_path)
    nodes, runs = state.read_nodes(store), state.read_runs(store)
    summary = state.summarize(nodes, runs)
    shown = nodes if show_all else nodes[~nodes.status.isin(state.SETTLED)]
    columns = ["cluster_name", "role", "status", "instance_id", "model", "phase", "region", "stage", "node",
               "instance_type", "use_spot", "usd_per_hour", "address", "plan_id"]
    shown = shown[columns].reset_index(drop=True)
    url = endpoint(nodes) if not nodes.empty else None
    if as_json:
        emit_json({**summary, "url": url, "nodes": _records(shown)})
        return
    if nodes.empty:
        click.echo("nothing deployed yet (run `coral launch --dry-run` to see what a plan would start)")
        return
    unpriced = summary["unpriced_clusters"]
    emit(shown, False, title=f"deployment: {summary['instances']} instance(s), "
                             f"{summary['gpu_usd_per_hour']:.2f} $/h of GPU nodes up"
                             + (f"; unpriced (no CPU VM price): {', '.join(unpriced)}" if unpriced else ""))
    if summary["last_run"]:
        last = summary["last_run"]
        click.echo(f"last run {last['run_id']} for plan {last['plan_id']}: {last['status']}")
    _echo_endpoint(url)
