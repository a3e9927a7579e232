"""The bundled "mega" scenario: AWS and GCP, every configuration the price files sell there, and a slice plans."""

from __future__ import annotations

from dataclasses import replace

from coral_dagster.allocation.inputs import scenario_problem
from coral_dagster.allocation.methods import make_plan
from coral_dagster.catalog.models import model_catalog
from coral_dagster.catalog.prices import load_node_prices
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.templates.library import build_library


def test_mega_offers_exactly_what_the_price_files_sell_in_twelve_regions_of_both_clouds():
    scn = load_scenario("mega")
    assert len(scn.regions) >= 10 and {r.split(":")[0] for r in scn.regions} == {"aws", "gcp"}
    assert {m.model for m in scn.models} == set(model_catalog())  # every model of the catalog
    offers = {(o.region, str(o.node)): o.usd_per_hour for o in scn.market().offers}
    table = load_node_prices()
    gpus = {n.gpu for n in scn.node_configs}
    sold = {(r.region, str(r.node)): float(r.usd_per_hour) for r in table.itertuples(index=False)
            if r.region in scn.regions and r.gpu in gpus}
    assert offers == sold  # no invented price, no sold configuration left out
    assert {r for r, _ in offers} == set(scn.regions)


def test_a_slice_of_mega_plans_within_its_market():
    scn = load_scenario("mega")
    scn = replace(scn, models=tuple(m for m in scn.models if m.model == "gpt-oss-20b"), n_max=1)
    problem = scenario_problem(scn, tuple(build_library(scn)), scn.market())
    plan = make_plan(problem, "coral", time_limit_s=30)
    assert plan.status == "optimal" and plan.instances
    for inst in plan.instances:
        assert (inst.region, inst.template.nodes.counts[0][0]) in problem.usd_per_hour
    served = plan.served_fraction()
    assert min(served.values()) >= 1.0 - 1e-9
