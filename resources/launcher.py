"""How the deployment asset deploys (`coral_dagster.app.deployment.deploy`): dry run (task YAMLs) by default, real
launches through SkyPilot when asked."""

from pathlib import Path

import dagster as dg
from pydantic import Field

from coral_dagster import paths


class SkyPilotLauncher(dg.ConfigurableResource):
    """Settings of the deployment asset's SkyPilot reconcile; `dry_run` only writes the tasks."""

    dry_run: bool = Field(default=True, description="Write YAMLs and commands; launch nothing.")
    out_dir: str = Field(default=str(paths.REPO_ROOT / "out" / "deploy"),
                         description="Where task YAMLs go (one folder per plan under it).")
    drain_timeout_s: float = Field(default=600.0, description="Seconds a removed instance may drain.")

    def deploy(self, store, plan):
        """`app.deployment.deploy` with these settings."""
        from coral_dagster.app.deployment import default_out, deploy

        return deploy(store, plan, dry_run=self.dry_run, out=default_out(plan.plan_id, Path(self.out_dir)),
                      drain_timeout_s=self.drain_timeout_s)
