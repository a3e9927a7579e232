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
from coral_dagster.catalog.gpus import gpu_catalog
from coral_dagster.catalog.models import get_model, model_catalog
from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.catalog.prices import load_node_prices
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
# What a plan file may name: the bundled price table's regions, each with the nodes it sells (GPU in the catalog).
PRICES = load_node_prices()
SOLD = {r: sorted(NodeConfig.parse(n) for n in rows.node if n.split(":")[0] in gpu_catalog())
        for r, rows in PRICES.groupby("region")}


@st.composite
def templates(draw, nodes) -> Template:
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


@st.composite
def instances(draw) -> PlannedInstance:
    region = draw(st.sampled_from(sorted(r for r in SOLD if SOLD[r])))
    return PlannedInstance(draw(templates(st.sampled_from(SOLD[region]))), region, draw(st.integers(1, MAX_COUNT)),
                           draw(finite))


keys = st.tuples(st.sampled_from(MODELS), st.sampled_from(PHASES))
numbers = st.dictionaries(words, finite, max_size=3)


@st.composite
def plans(draw) -> Plan:
    admitted = draw(st.lists(st.sampled_from(MODELS), max_size=3, unique=True))
    return Plan(
        scenario=draw(words), method=draw(st.sampled_from(METHODS)), status=draw(st.sampled_from(SOLVE_STATUSES)),
        cost_usd_per_hour=draw(finite), lp_bound_usd_per_hour=draw(bound), gap=draw(bound), solve_s=draw(finite),
        instances=tuple(draw(st.lists(instances(), max_size=4))),
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
    """What a file load gives without a store to compare with: the plan under its content hash, `file-…`."""
    loaded = load_plan_file(path, None)
    assert loaded.plan_id.startswith("file-") and loaded.plan_id != plan.plan_id
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
    doc = plan_to_doc(plan, derived=False)
    doc["instances"][0]["count"] = MAX_COUNT + 1
    with pytest.raises(CatalogError, match="'count'"):
        plan_from_doc(doc)
    doc = plan_to_doc(plan, derived=False)
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
    # The share each model is held to is what the plan serves of its demand (5 of 10 req/s).
    assert parse_admit(envs["CORAL_ADMIT"]) == ({"phi-4": 1.25}, {"phi-4": 40.0}, {"phi-4": (3.0, 6.0)},
                                                {"phi-4": 5.0 / 10.0})


@pytest.mark.slow
def test_coral_plan_json_loads_as_the_plan_it_stored(tmp_path, small_store):
    """The document `coral plan --json` prints, saved as a file, is the plan the store holds (real solve)."""
    scenario, db = small_store
    res = CliRunner().invoke(main, ["plan", "--scenario", str(scenario), "--json", "--db", str(db)])
    assert res.exit_code == 0, res.output
    printed = res.output[res.output.index("{"):]
    path = tmp_path / "plan.json"
    path.write_text(printed)
    plan_id = json.loads(printed)["plan_id"]
    assert same(load_plan_file(path, Store(db)), load_plan(Store(db), plan_id))


def _core_plan() -> Plan:
    """Phi-4 in core on L40S:1 in aws:us-east-2 (a node that region sells): one prefill, two decode instances."""
    from coral_dagster.catalog.scenarios import load_scenario

    l40s = NodeConfig.parse("L40S:1")
    pre = Template("phi-4", "prefill", 1200.0, NodeMultiset.of([l40s, l40s]),
                   (Stage(0, 20, (l40s,), (1.0,)), Stage(20, 40, (l40s,), (1.0,))), 9000.0, "compute")
    dec = Template("phi-4", "decode", 60.0, NodeMultiset.of([l40s]), (Stage(0, 40, (l40s,), (1.0,)),), 700.0,
                   "memory")
    return Plan("core", "coral", "optimal", 4.0, 4.0, 0.0, 0.1,
                (PlannedInstance(pre, "aws:us-east-2", 1, 2.0), PlannedInstance(dec, "aws:us-east-2", 2, 1.0)),
                {("phi-4", "prefill"): 1.0, ("phi-4", "decode"): 1.0},
                {("phi-4", "prefill"): 9000.0, ("phi-4", "decode"): 1400.0},
                scenario_key=load_scenario("core").scenario_key)


def _newest_attainment(db: Path, plan_id: str) -> dict[str, tuple[float, int]]:
    """The README's "newest simulation" query for one plan: each model's newest attainment, and how many runs."""
    rows = Store(db).query("SELECT model, max_by(attainment, simulated_at) AS attainment, count(*) AS runs "
                           "FROM simulations WHERE plan_id = ? GROUP BY model", [plan_id])
    return {r.model: (r.attainment, r.runs) for r in rows.itertuples()}


EDITS = [
    ("serves nothing", lambda d: d.update(instances=[])),
    ("one instance fewer", lambda d: d["instances"][1].update(count=1, usd_per_hour=1.0, tokens_per_s=700.0)),
    ("cheaper", lambda d: d.update(cost_usd_per_hour=1.0)),
    ("id of another stored plan", lambda d: d.update(plan_id="no-such-plan")),
]


@pytest.mark.parametrize("label,edit", EDITS, ids=[e[0] for e in EDITS])
def test_an_edited_plan_file_is_never_recorded_as_the_stored_plan(tmp_path, label, edit):
    """Against a real store: the stored plan's own JSON keeps its id and its simulation is recorded under it; the
    same file edited (or naming an id the store lacks) gets an id of its own, is not recorded, and the README's
    newest-simulation query still reports the stored plan's run."""
    db = tmp_path / "coral.duckdb"
    stored = store_plan(Store(db), _core_plan(), "codec-test", {})
    sim = ["simulate", "--scenario", "core", "--duration-s", "20", "--rate-scale", "0.3", "--db", str(db), "--json"]
    path = tmp_path / "plan.json"
    path.write_text(plan_to_json(stored))
    assert load_plan_file(path, Store(db)).plan_id == stored.plan_id
    first = CliRunner().invoke(main, [*sim, "--plan", str(path)])
    assert first.exit_code == 0, first.output
    assert stored.plan_id in json.loads(first.output)["recorded"]
    before = _newest_attainment(db, stored.plan_id)
    assert set(before) == {"phi-4", "qwen3-32b", "gpt-oss-20b"} and {r for _, r in before.values()} == {1}

    doc = plan_to_doc(stored)
    edit(doc)
    path.write_text(json.dumps(doc))
    loaded = load_plan_file(path, Store(db))
    assert loaded.plan_id.startswith("file-") and loaded.plan_id != stored.plan_id
    res = CliRunner().invoke(main, [*sim, "--plan", str(path)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["recorded"].startswith("not recorded")
    assert _newest_attainment(db, stored.plan_id) == before
    assert Store(db).query("SELECT count(DISTINCT plan_id) AS n FROM simulations")["n"].item() == 1


def test_a_plan_file_that_only_names_a_stored_plan_must_list_its_instances(tmp_path):
    """A stageless file is a reference: it loads the stored plan, and refuses instances that are not the plan's."""
    db = tmp_path / "coral.duckdb"
    stored = store_plan(Store(db), _core_plan(), "codec-test", {})
    rows = [{k: v for k, v in row.items() if k != "stages"} for row in plan_to_doc(stored)["instances"]]
    path = tmp_path / "ref.json"
    path.write_text(json.dumps({"plan_id": stored.plan_id, "instances": rows}))
    assert same(load_plan_file(path, Store(db)), load_plan(Store(db), stored.plan_id))
    rows[1]["count"] = 5
    path.write_text(json.dumps({"plan_id": stored.plan_id, "instances": rows}))
    with pytest.raises(CatalogError, match="'instances'.*not those of stored plan.*Fix: give each instance"):
        load_plan_file(path, Store(db))


@pytest.mark.parametrize("field,change,fix", [
    ("region", lambda r: r.update(region="aws:mars-1"), "aws:us-east-2"),
    ("nodes", lambda r: [s.update(nodes=["B300:1"]) for s in r["stages"]] and r.update(nodes="2xB300:1"),
     "use one of A100, A100-80GB"),
    ("nodes", lambda r: r.update(region="gcp:us-central1"), "use one of"),
])
def test_a_plan_file_naming_what_the_catalogs_lack_is_refused(tmp_path, field, change, fix):
    """A region the price table has no row for, a GPU the catalog lacks, and a node its region does not sell (L40S is
    sold on AWS only, per the bundled price table) each name the row, the field and the fix."""
    assert "L40S:1" not in set(PRICES[PRICES.region == "gcp:us-central1"].node)
    doc = plan_to_doc(_core_plan())
    change(doc["instances"][0])
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(CatalogError, match=f"instances\\[0\\].*'{field}'.*Fix: .*{fix}"):
        load_plan_file(path, None)
    res = CliRunner().invoke(main, ["launch", "--dry-run", "--plan", str(path), "--out", str(tmp_path / "d"),
                                    "--db", str(tmp_path / "s.duckdb")])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit) and f"'{field}'" in res.output
