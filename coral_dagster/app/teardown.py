"""Taking the recorded deployment down: what would go (a dry run) and the drain-then-down run itself."""

from __future__ import annotations


def teardown_steps(db_path: str | None) -> tuple[list[str], list[str]]:
    """(clusters, commands) a teardown would run: each instance drained through the coordinator, then its clusters
    `sky down`, the coordinator last."""
    from coral_dagster.deploy import state, tasks
    from coral_dagster.deploy.reconcile import COORDINATOR_SLOT, teardown_removals
    from coral_dagster.store import Store

    removals = teardown_removals(state.read_nodes(Store(db_path)))
    steps: list[str] = []
    for r in removals:
        if r.instance_id != COORDINATOR_SLOT:
            steps.append(f"# drain {r.instance_id} through the coordinator, then:")
        steps += [tasks.down_command(c) for c in r.clusters]
    return [c for r in removals for c in r.clusters], steps


def take_down(db_path: str | None, drain_timeout_s: float):
    """Drain and `sky down` every recorded cluster (the state in the store records each step); the run's report."""
    from coral_dagster.deploy.drain import CoordinatorDrainer
    from coral_dagster.deploy.reconcile import teardown
    from coral_dagster.deploy.sky_adapter import SkyLauncher
    from coral_dagster.store import Store

    return teardown(Store(db_path), SkyLauncher(), CoordinatorDrainer(), drain_timeout_s)
