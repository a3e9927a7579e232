"""One plan codec: every plan round-trips unchanged through a plan file, the DuckDB store and `--json` output; a
plan file that is too large, too deep or not finite is a CoralError, and a plan file launches with its admission."""

from __future__ import annotations

import json
import math
from dataclasses import fields, is_dataclass, replace
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coral_dagster.allocation.codec import (MAX_COUNT, MAX_DEPTH, parse_plan_text, plan_from_doc, plan_to_doc,
                                           plan_to_json)
from coral_dagster.allocation.storage import load_plan, store_plan
from coral_dagster.allocation.types import AdmissionLimits, Bottleneck, Plan, PlannedInstance
from coral_dagster.app.plan_files import load_plan_file
from coral_dagster.catalog.models import get_model, model_catalog
from coral_dagster.catalog.nodes import GPUS_PER_NODE, NodeConfig, NodeMultiset
from coral_dagster.cli._out import emit_json
from coral_dagster.cli.main import main
from coral_dagster.errors import CatalogError, CoralError
from coral_dagster.store import Store
from coral_dagster.templates.types import Stage, Template
from coral_dagster.vocab import BOUNDS, METHODS, PHASES, SOLVE_STATUSES

MODELS = sorted(model_catalog())
finite = st.floats(min_value=0.0, max_value=1e12, allow_nan=False, allow_infinity=False)
positive = st.floats(min_value=1e-9, max_value=1e12, allow_nan=False, allow_infinity=False)
bound = st.one_of(st.just(math.nan), st.floats(min_value=-1e12, max_value=1e12, allow_nan=False))
words = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
nodes = st.builds(NodeConfig, st.sampled_from(("L4", "L40S", "A100", "H100", "H200")), st.sampled_from(GPUS_PER_NODE))
regions = st.from_regex(r"\A(aws|gcp):[a-z0-9-]{1,12}\Z")


@st.composite
def templates(draw) -> Template:
    model = draw(st.sampled_from(MODELS))
    layers = get_model(model).n_layers
    cuts = sorted(draw(st.sets(st.integers(1, layers - 1), max_size=3)))
    stages = []
    for start, end in zip([0, *cuts], [*cuts, layers]):
        members = draw(st.lists(nodes, min_size=1, max_size=3))
        shares = draw(st.lists(st.floats(0.0, 1.0), min_size=len(members), max_size=len(members)))
        batches = draw(st.one_of(st.just([]), st.lists(st.integers(1, 65536), min_size=len(members),
                                                       max_size=len(members))))
        stages.append(Stage(start, end, tuple(members), tuple(shares), tuple(batches)))
    return Template(model, draw(st.sampled_from(PHASES)), draw(finite), NodeMultiset.of(
        [n for s in stages for n in s.nodes]), tuple(stages), draw(positive),
        draw(st.sampled_from(BOUNDS)))


keys = st.tuples(st.sampled_from(MODELS), st.sampled_from(PHASES))
numbers = st.dictionaries(words, finite, max_size=3)


@st.composite
def plans(draw) -> Plan:
    admitted = draw(st.lists(st.sampled_from(MODELS), max_size=3, unique=True))
    return Plan(
        scenario=draw(words), method=draw(st.sampled_from(METHODS)), status=draw(st.sampled_from(SOLVE_STATUSES)),
        cost_usd_per_hour=draw(finite), lp_bound_usd_per_hour=draw(bound), gap=draw(bound), solve_s=draw(finite),
        instances=tuple(draw(st.lists(st.builds(PlannedInstance, templates(), regions, st.integers(1, MAX_COUNT),
                                                finite), max_size=4))),
        demand_tokens_per_s=draw(st.dictionaries(keys, finite, max_size=4)),
        served_tokens_per_s=draw(st.dictionaries(keys, finite, max_size=4)),
        demand_scale=draw(finite), notes=tuple(draw(st.lists(words, max_size=3))), churn_usd_per_hour=draw(finite),
        mip_bound_usd_per_hour=draw(bound),
        bottlenecks=tuple(draw(st.lists(st.builds(Bottleneck, st.sampled_from(("demand", "node")), words, words,
                                                  finite, finite), max_size=2))),
        pruning=draw(st.one_of(st.none(), st.dictionaries(words, st.integers(0, 10**9), max_size=3))),
        snapshot_id=draw(words), timings_s=draw(numbers), plan_id=draw(st.one_of(st.just(""), words)),
        admission=AdmissionLimits(
            capacity_factors=draw(st.dictionaries(keys, finite, max_size=3)),
            admit_req_s={m: draw(finite) for m in admitted},
            admit_depth_req={m: draw(finite) for m in admitted},
            admit_peak={m: (draw(finite), draw(finite)) for m in admitted}),
        expected_attainment=draw(st.dictionaries(st.sampled_from(MODELS), st.floats(0.0, 1.0), max_size=3)),
        expected_from=draw(words), scenario_key=draw(words), work_nodes=draw(st.integers(0, 10**9)))


def same(a, b) -> bool:
    """Equal field by field, NaN equal to NaN (a plan with no bound has NaN there on both sides)."""
    if is_dataclass(a) and type(a) is type(b):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    return Store(tmp_path_factory.mktemp("codec") / "codec.duckdb")


def _expect_from_file(plan: Plan, path: Path) -> Plan:
    """What a file load gives: the plan with its own id, else the file's content hash as `file-…`."""
    loaded = load_plan_file(path, None)
    assert plan.plan_id and loaded.plan_id == plan.plan_id or not plan.plan_id and loaded.plan_id.startswith("file-")
    return replace(loaded, plan_id=plan.plan_id)


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                           HealthCheck.too_slow])


@SETTINGS
@given(plan=plans())
def test_every_plan_round_trips_through_a_plan_file(plan, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(plan_to_json(plan))
    assert same(_expect_from_file(plan, path), plan)


@pytest.mark.slow
@SETTINGS
@given(plan=plans())
def test_every_plan_round_trips_through_the_store(plan, store):
    stored = store_plan(store, plan, "codec-test", {})
    assert stored.plan_id and same(load_plan(store, stored.plan_id), replace(plan, plan_id=stored.plan_id))


@pytest.mark.slow
@SETTINGS
@given(plan=plans())
def test_every_plan_round_trips_through_json_output_into_a_file(plan, tmp_path, capsys):
    """What the CLI's `--json` prints (`emit_json` of the codec's document), saved as a file, loads unchanged."""
    capsys.readouterr()
    emit_json(plan_to_doc(plan))
    path = tmp_path / "printed.json"
    path.write_text(capsys.readouterr().out)
    assert same(_expect_from_file(plan, path), plan)


def test_a_store_whose_first_plan_is_empty_takes_the_next(tmp_path):
    """An empty plan first creates `plan_instances` and `plan_routes` from empty frames; later rows still fit."""
    store = Store(tmp_path / "empty-first.duckdb")
    store_plan(store, Plan("s", "coral", "infeasible", 0.0, math.nan, math.nan, 0.0, (), {}, {}), "r", {})
    l4 = NodeConfig.parse("L4:1")
    template = Template("phi-4", "prefill", 1.0, NodeMultiset.of([l4]), (Stage(0, 40, (l4,), (1.0,)),), 9.0, "slo")
    plan = Plan("s", "coral", "optimal", 1.0, 1.0, 0.0, 0.0, (PlannedInstance(template, "aws:us-east-2", 2, 0.5),),
                {("phi-4", "prefill"): 9.0}, {("phi-4", "prefill"): 18.0})
    stored = store_plan(store, plan, "r", {})
    assert same(load_plan(store, stored.plan_id), stored)
    assert store.query("SELECT count(*) AS n FROM plan_instances")["n"].item() == 1


def test_a_bound_that_is_not_finite_is_no_bound():
    plan = Plan("s", "coral", "optimal", 1.0, -math.inf, math.inf, 0.0, (), {}, {}, mip_bound_usd_per_hour=math.inf)
    assert all(math.isnan(x) for x in (plan.lp_bound_usd_per_hour, plan.gap, plan.mip_bound_usd_per_hour))


@pytest.mark.parametrize("text,problem", [
    ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "nests"),
    ('{"a": ' * 100_000 + "1" + "}" * 100_000, "nests"),
    ('{"instances": [], "x": "' + "[" * 100 + '"}', None),  # brackets inside a string do not nest
    ('{"cost_usd_per_hour": 1e999, "instances": []}', "too large"),
    ('{"cost_usd_per_hour": NaN, "instances": []}', "NaN"),
    ("[]", "expected a JSON object"),
])
def test_a_plan_text_is_bounded_before_it_is_parsed(text, problem):
    if problem is None:
        assert parse_plan_text(text)["instances"] == []
        return
    with pytest.raises(CoralError, match=problem):
        parse_plan_text(text, "p.json")


def test_a_plan_file_larger_than_the_limit_is_refused_unread(tmp_path, monkeypatch):
    import coral_dagster.allocation.codec as codec

    monkeypatch.setattr(codec, "MAX_PLAN_BYTES", 100)
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"instances": [], "notes": ["x" * 200]}))
    with pytest.raises(CoralError, match="more than the 100"):
        load_plan_file(path, None)


@given(plan=plans().filter(lambda p: p.instances))
@settings(max_examples=20, deadline=None)
def test_a_count_above_the_cap_or_totals_that_disagree_name_their_field(plan):
    doc = plan_to_doc(plan)
    doc["instances"][0]["count"] = MAX_COUNT + 1
    with pytest.raises(CatalogError, match="'count'"):
        plan_from_doc(doc)
    doc = plan_to_doc(plan)
    doc["instances"][0]["usd_per_hour"] = doc["instances"][0]["usd_per_hour"] * 2 + 1
    with pytest.raises(CatalogError, match="'usd_per_hour'"):
        plan_from_doc(doc)


def test_a_plan_file_launches_with_its_admission_limits(tmp_path):
    """`coral launch --plan FILE` gives the coordinator the file's admission (`CORAL_ADMIT`), read back exactly as
    the coordinator's `--admit` parses it; the oracle is the plan's own admission, not the codec."""
    from coral_dagster.runtime.config import parse_admit

    l40s = NodeConfig.parse("L40S:1")
    template = Template("phi-4", "aggregated", 60.0, NodeMultiset.of([l40s]), (Stage(0, 40, (l40s,), (1.0,)),),
                        1000.0, "compute")
    admission = AdmissionLimits({("phi-4", "prefill"): 2.5}, {"phi-4": 1.25}, {"phi-4": 40.0}, {"phi-4": (3.0, 6.0)})
    plan = Plan("small", "coral", "scaled", 1.0, 1.0, 0.0, 0.0, (PlannedInstance(template, "aws:us-east-2", 1, 1.0),),
                {("phi-4", "prefill"): 10.0}, {("phi-4", "prefill"): 5.0}, admission=admission)
    path = tmp_path / "plan.json"
    path.write_text(plan_to_json(plan))
    res = CliRunner().invoke(main, ["launch", "--plan", str(path), "--dry-run", "--out", str(tmp_path / "d"),
                                    "--json", "--db", str(tmp_path / "state.duckdb")])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output[res.output.index("{"):])
    (coordinator,) = [p for p in out["yaml"] if "coord" in Path(p).name]
    envs = yaml.safe_load(Path(coordinator).read_text())["envs"]
    assert parse_admit(envs["CORAL_ADMIT"]) == ({"phi-4": 1.25}, {"phi-4": 40.0}, {"phi-4": (3.0, 6.0)})


@pytest.mark.slow
def test_coral_plan_json_loads_as_the_plan_it_stored(tmp_path):
    """The document `coral plan --json` prints, saved as a file, is the plan the store holds (real solve)."""
    from support.scenario_docs import build_small

    scenario, db = build_small(tmp_path)
    res = CliRunner().invoke(main, ["plan", "--scenario", str(scenario), "--json", "--db", str(db)])
    assert res.exit_code == 0, res.output
    printed = res.output[res.output.index("{"):]
    path = tmp_path / "plan.json"
    path.write_text(printed)
    plan_id = json.loads(printed)["plan_id"]
    assert same(load_plan_file(path, None), load_plan(Store(db), plan_id))
