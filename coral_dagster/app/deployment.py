"""Deploying a stored plan, the one path `coral launch` and the `deployment_specs` asset take: node prices and
instance types from the market snapshot the plan was made on, the deployment's full cost beside the plan's, then
a dry run (task YAMLs and commands) or a reconcile through SkyPilot."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from coral_dagster.allocation.types import Plan
from coral_dagster.deploy.cost import DeploymentCost
from coral_dagster.deploy.dry_run import DryRun
from coral_dagster.deploy import state as state
from coral_dagster.deploy.reconcile import Diff, ReconcileReport
from coral_dagster.deploy.spec import GPU_ROLES as GPU_ROLES
from coral_dagster.errors import CoralError
from coral_dagster.store.duck import Store


def snapshot_prices(store: Store, plan: Plan, prices: pd.DataFrame | None = None) -> tuple[pd.DataFrame, str]:
    """(price rows: region, node, instance type, on-demand and spot $/h; where they come from): the plan's own
    market snapshot when the store holds it; for a plan file whose snapshot was never stored, the current price
    table (`prices`, a `--prices` file's rows; default `load_node_prices()`), and the source says so."""
    if plan.snapshot_id and "market_snapshots" in store.tables():
        rows = store.query("SELECT region, node, gpu, gpus, instance_type, usd_per_hour, spot_usd_per_hour "
                           "FROM market_snapshots WHERE snapshot_id = ?", [plan.snapshot_id])
        if not rows.empty:
            return rows, f"market snapshot {plan.snapshot_id}"
    if plan.plan_id and not plan.plan_id.startswith("file-"):
        raise CoralError(f"market snapshot {plan.snapshot_id or '(none)'} of plan {plan.plan_id} is not in "
                         f"{store.path}.", "re-plan on a stored snapshot (`coral plan`), then deploy that plan.")
    from coral_dagster.catalog.prices import load_node_prices

    source = f"the current price table (plan file; its snapshot {plan.snapshot_id or '(none)'} is not stored)"
    return (load_node_prices() if prices is None else prices), source


def default_out(plan_id: str, root: Path | None = None) -> Path:
    """Where a dry run writes a plan's task YAMLs: `<root>/<plan tag>`, root `out/deploy` of the repository."""
    from coral_dagster import paths
    from coral_dagster.deploy.names import plan_tag

    return (root or paths.REPO_ROOT / "out" / "deploy") / plan_tag(plan_id)


@dataclass(frozen=True)
class Deployment:
    """What deploying a plan did: its pricing and full cost, and either the dry run (diff, YAMLs) or the reconcile
    report."""

    plan: Plan
    priced_from: str
    cost: DeploymentCost
    diff: Diff | None = None
    dry: DryRun | None = None
    out: Path | None = None
    report: ReconcileReport | None = None
    # The OpenAI base URL of the live coordinator after a reconcile (None when none is up).
    url: str | None = None

    def as_dict(self) -> dict:
        head = {"plan_id": self.plan.plan_id, "method": self.plan.method, "dry_run": self.dry is not None,
                "priced_from": self.priced_from, "plan_usd_per_hour": round(self.plan.cost_usd_per_hour, 4),
                **self.cost.as_dict()}
        if self.report is not None:
            return {**self.report.as_dict(), **head, "url": self.url}
        assert self.diff is not None and self.dry is not None
        return {**head, "out": str(self.out), "yaml": [str(p) for p in self.dry.yaml_paths],
                "script": str(self.dry.script), "commands": list(self.dry.commands),
                "launch": len(self.diff.nodes_to_launch()),
                "remove": len(self.diff.remove), "keep": list(self.diff.keep)}


def deploy(store: Store, plan: Plan, *, dry_run: bool = True, out: Path | None = None,
           drain_timeout_s: float = 600.0, retry_until_up: bool = False, plain_http: bool = False,
           prices: pd.DataFrame | None = None) -> Deployment:
    """Deploy `plan` (its own `plan_id`), priced from its own snapshot (a plan file without a stored one: from
    `prices`, default `load_node_prices()`): a dry run writes the diff against the recorded deployment as task
    YAMLs and commands into `out` (default `default_out`); otherwise reconcile through SkyPilot, draining removed
    instances for up to `drain_timeout_s`. Instances run on the plan's engine
    (`app.plans.plan_engine`): under `vllm`, its prefill and decode templates as vLLM PD instances."""
    from coral_dagster.deploy import state
    from coral_dagster.deploy.cost import deployment_cost
    from coral_dagster.deploy.dry_run import write_dry_run
    from coral_dagster.app.plans import plan_engine
    from coral_dagster.deploy.reconcile import plan_diff, reconcile

    engine = plan_engine(store, plan)
    prices, source = snapshot_prices(store, plan, prices)
    cost = deployment_cost(plan, plan.plan_id, prices, source)
    if dry_run:
        diff = plan_diff(plan, plan.plan_id, state.read_nodes(store), prices, engine, plain_http)
        folder = out or default_out(plan.plan_id)
        return Deployment(plan, source, cost, diff=diff, dry=write_dry_run(diff, folder), out=folder)
    from coral_dagster.deploy.drain import CoordinatorDrainer
    from coral_dagster.deploy.sky_adapter import SkyLauncher

    report = reconcile(plan, plan.plan_id, store, SkyLauncher(retry_until_up=retry_until_up), CoordinatorDrainer(),
                       prices, drain_timeout_s, engine, plain_http)
    return Deployment(plan, source, cost, report=report, url=endpoint(state.read_nodes(store)))


def endpoint(nodes: pd.DataFrame) -> str | None:
    """The OpenAI base URL clients call among the recorded nodes: the endpoint's, else (a deployment launched before
    there was one) the live coordinator's; None when neither is up."""
    from coral_dagster.deploy.tasks import HTTPS_SCHEME, PLAIN_SCHEME, http_url

    up = nodes[nodes.role.isin(("endpoint", "coordinator")) & (nodes.status == "launched") & nodes.address.notna()]
    up = up.sort_values("role", key=lambda r: r != "endpoint", kind="stable")
    # A coordinator row's phase holds the scheme it serves; older rows (empty) served plain HTTP.
    return http_url(up.address.iloc[0], HTTPS_SCHEME if up.phase.iloc[0] == HTTPS_SCHEME else PLAIN_SCHEME) \
        if len(up) else None
