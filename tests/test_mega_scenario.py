"""The bundled "mega" scenario: AWS and GCP, every configuration the price files sell there, 24 served models over
the whole catalog, an explicit `nodes:` list, and a slice plans."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from coral_dagster.allocation.inputs import scenario_problem
from coral_dagster.allocation.methods import make_plan
from coral_dagster.catalog.models import model_catalog
from coral_dagster.catalog.prices import load_node_prices
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.errors import CatalogError
from coral_dagster.templates.library import build_library


def test_mega_offers_exactly_what_the_price_files_sell_in_twelve_regions_of_both_clouds():
    scn = load_scenario("mega")
    assert len(scn.regions) >= 10 and {r.split(":")[0] for r in scn.regions} == {"aws", "gcp"}
    assert len(scn.models) >= 20 and {m.base for m in scn.models} == set(model_catalog())  # every catalog family
    assert len({m.rate_req_s for m in scn.models}) > 5
    offers = {(o.region, str(o.node)): o.usd_per_hour for o in scn.market().offers}
    table = load_node_prices()
    gpus = {"H200", "H100", "A100-80GB", "A100", "L40S", "A40", "L4", "A10G", "T4", "V100"}  # as its header says
    sold = {(r.region, str(r.node)): float(r.usd_per_hour) for r in table.itertuples(index=False)
            if r.region in scn.regions and r.gpu in gpus}
    assert offers == sold  # no invented price, no sold configuration left out
    assert {r for r, _ in offers} == set(scn.regions)
    assert {str(n) for n in scn.node_configs} == {n for _, n in sold}  # exactly the sold configurations


@pytest.mark.slow
def test_a_slice_of_mega_plans_within_its_market():
    scn = load_scenario("mega")
    scn = replace(scn, models=tuple(m for m in scn.models if m.base == "gpt-oss-20b"), n_max=1)
    problem = scenario_problem(scn, tuple(build_library(scn)), scn.market())
    plan = make_plan(problem, "coral", time_limit_s=30)
    assert plan.status == "optimal" and plan.instances
    for inst in plan.instances:
        assert (inst.region, inst.template.nodes.counts[0][0]) in problem.usd_per_hour
    served = plan.served_fraction()
    assert min(served.values()) >= 1.0 - 1e-9


def test_a_nodes_list_is_the_same_scenario_as_gpus_times_counts(tmp_path):
    doc = yaml.safe_load(open(load_scenario("core").path))
    grid = load_scenario("core")
    listed = {k: v for k, v in doc.items() if k not in ("gpus", "gpus_per_node")}
    listed["nodes"] = [str(n) for n in grid.node_configs]
    path = tmp_path / "core.yaml"
    path.write_text(yaml.safe_dump(listed))
    assert load_scenario(path).node_configs == grid.node_configs
    assert load_scenario(path).library_key == grid.library_key


@pytest.mark.parametrize("change, words", [
    ({"nodes": ["L4:1"]}, "not both"),  # beside gpus
    ({"gpus": ..., "gpus_per_node": ..., "nodes": ["L4:1", "L4:1"]}, "duplicate"),
    ({"gpus": ..., "gpus_per_node": ..., "nodes": ["L4:3"]}, "GPUs per node"),
    ({"gpus": ..., "gpus_per_node": ..., "nodes": []}, "non-empty list"),
    ({"gpus": ..., "gpus_per_node": ..., "nodes": ["B300:8"]}, "unknown GPU"),
])
def test_a_bad_nodes_list_is_named_with_the_fix(tmp_path, change, words):
    doc = yaml.safe_load(open(load_scenario("core").path))
    doc.update(change)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in doc.items() if v is not ...}))
    with pytest.raises(CatalogError, match=words) as err:
        load_scenario(path)
    assert err.value.field.startswith("nodes") or err.value.row == "nodes"
