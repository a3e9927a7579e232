"""The SkyPilot launcher as a Dagster resource: dry-run (write task YAMLs) by default, real launches when asked."""

from pathlib import Path

import dagster as dg
from pydantic import Field

from coral_dagster import paths


class SkyPilotLauncher(dg.ConfigurableResource):
    """Reconciles the running deployment to a plan through SkyPilot; `dry_run` only writes the tasks."""

    dry_run: bool = Field(default=True, description="Write YAMLs and commands; launch nothing.")
    out_dir: str = Field(default=str(paths.REPO_ROOT / "out" / "deploy"), description="Where task YAMLs go.")
    drain_timeout_s: float = Field(default=600.0, description="Seconds a removed instance may drain.")

    def deploy(self, store, plan, prices) -> dict:
        """Dry run: the diff against the recorded deployment, as YAMLs and commands. Otherwise: reconcile.
        `prices` are the rows of the plan's own market snapshot."""
        from coral_dagster.app.plans import plan_engine
        from coral_dagster.deploy import state
        from coral_dagster.deploy.names import plan_tag
        from coral_dagster.deploy.dry_run import write_dry_run
        from coral_dagster.deploy.reconcile import plan_diff, reconcile

        plan_id, engine = plan.plan_id, plan_engine(store, plan)
        if self.dry_run:
            diff = plan_diff(plan, plan_id, state.read_nodes(store), prices, engine)
            dry = write_dry_run(diff, Path(self.out_dir) / plan_tag(plan_id))
            return {"dry_run": True, "yaml": [str(p) for p in dry.yaml_paths], "script": str(dry.script),
                    "commands": list(dry.commands),
                    "launch": len(diff.nodes_to_launch()), "remove": len(diff.remove), "keep": len(diff.keep)}
        from coral_dagster.deploy.drain import CoordinatorDrainer
        from coral_dagster.deploy.sky_adapter import SkyLauncher

        return reconcile(plan, plan_id, store, SkyLauncher(), CoordinatorDrainer(), prices,
                         self.drain_timeout_s, engine).as_dict()
