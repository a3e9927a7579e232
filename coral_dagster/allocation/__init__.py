"""Stage 2: the online allocation of template instances to regions, and the baselines."""

from __future__ import annotations


def plan_scenario(scenario, **options):
    """Plan a bundled scenario end to end (see `scenario_plans.plan_scenario`); imported lazily."""
    from coral_dagster.allocation.scenario_plans import plan_scenario as run

    return run(scenario, **options)
