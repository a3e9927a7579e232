"""A plan holds its SLOs at its planned rate: the simulator (an independent event-driven model) is the oracle."""

from __future__ import annotations

import pytest
import yaml

from coral_dagster import paths
from coral_dagster.app.scenario_plans import plan_scenario
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.simulator.simulate import simulate_plan
from coral_dagster.templates.library import build_library

pytestmark = pytest.mark.slow  # a real two-model plan and minutes of simulation (`-m "not slow"` leaves it out)

MODELS = ("gpt-oss-20b", "phi-4")


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    doc = yaml.safe_load((paths.SCENARIOS_DIR / "core.yaml").read_text())
    doc["models"] = [m for m in doc["models"] if m["model"] in MODELS]
    path = tmp_path_factory.mktemp("scenario") / "core-two.yaml"
    path.write_text(yaml.safe_dump(doc))
    scn = load_scenario(path)
    templates = build_library(scn, models=list(MODELS))
    return scn, plan_scenario(scn, templates=templates, burst_aware=False), plan_scenario(scn, templates=templates)


def test_poisson_at_the_planned_rate_meets_the_slo(planned):
    """A plan sized for smooth arrivals (mean rate × headroom) holds its SLOs on Poisson arrivals."""
    scn, plan, _ = planned
    res = simulate_plan(plan, scn, trace="poisson", duration_s=240, seed=1)
    for model in MODELS:
        assert res.attainment_by_model[model] >= 0.95, (model, res.attainment_by_model)


def test_twice_the_planned_rate_does_not(planned):
    scn, plan, _ = planned
    res = simulate_plan(plan, scn, trace="poisson", duration_s=240, seed=1, rate_scale=2.0)
    # The plan is sized for the rate, not far beyond it: at 2× some model falls well below its SLO (measured at
    # seeds 0-2: phi-4 74% / 57% / 48%; whole nodes leave gpt-oss-20b spare room, 93-98%).
    assert min(res.attainment_by_model.values()) < 0.8, res.attainment_by_model
    assert res.attainment < 0.9, res.attainment


@pytest.mark.parametrize("seed", [0, 7])
def test_burst_aware_plan_holds_its_target_on_the_scenario_traces(planned, seed):
    """Sized by the capacity rule, the plan meets each model's attainment target on its own bursty trace (the Azure
    code trace's 10-s windows reach ~13× its mean), where the smooth plan does not."""
    scn, smooth, bursty = planned
    res = simulate_plan(bursty, scn, trace="scenario", duration_s=600, seed=seed)
    for m in scn.models:
        assert res.attainment_by_model[m.model] >= m.attainment_target, res.attainment_by_model
    assert bursty.admission.capacity_factors[("gpt-oss-20b", "prefill")] > 2.0
    worse = simulate_plan(smooth, scn, trace="scenario", duration_s=600, seed=seed)
    assert worse.attainment_by_model["gpt-oss-20b"] < 0.95


def test_each_model_simulated_alone_is_the_joint_simulation(planned):
    """The closed loop simulates each model alone, in parallel: models share no instance, node or link and draw
    from their own streams, so each model's requests fare exactly as in the joint simulation (the oracle)."""
    from coral_dagster.allocation.inputs import scenario_rates
    from coral_dagster.app.closed_loop import loop_duration_s, simulated_attainment, worst_window_attainment

    scn, _, plan = planned
    joint = simulate_plan(plan, scn, trace="scenario", duration_s=300, seed=3).requests
    for model in MODELS:
        alone = simulate_plan(plan, scn, trace="scenario", duration_s=300, seed=3,
                              rates={m: 0.0 for m in MODELS if m != model}).requests
        assert len(alone) and set(alone.model) == {model}
        mine = joint[joint.model == model].reset_index(drop=True)
        assert mine.equals(alone.reset_index(drop=True)), model
    rates = scenario_rates(scn, "uniform")
    together = simulated_attainment(plan, scn, rates, 600.0, 0, loop_duration_s(scn, rates, 600.0))
    assert worst_window_attainment(plan, scn, rates, 600.0, 0, processes=2) == together
    assert set(together) == set(MODELS)
