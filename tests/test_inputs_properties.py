"""Property-based (Hypothesis): any scenario file and any CLI float give a clear error or a valid result, never a
traceback and never NaN in the output."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.scenario_docs import SMALL, copy_small, with_field

from coral_dagster import paths
from coral_dagster.catalog import scenarios as sc
from coral_dagster.cli.main import main
from coral_dagster.errors import CoralError

CORE = yaml.safe_load((paths.SCENARIOS_DIR / "core.yaml").read_text())
ANY = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**12, 10**12), st.booleans(), st.none(),
    st.text(max_size=12), st.sampled_from(["aws:us-east-2", "gcp:us-central1", "L4:1", "phi-4", "azure-code"]),
    st.lists(st.one_of(st.integers(-2, 10), st.text(max_size=6)), max_size=3),
    st.dictionaries(st.text(max_size=6), st.integers(-3, 50), max_size=2),
)
# Values inside the format's bounds for most numeric fields, so that accepted files are common too.
PLAUSIBLE = st.one_of(st.floats(1.0, 8.0), st.integers(1, 6))
VALUE = st.one_of(PLAUSIBLE, PLAUSIBLE, ANY)
CORE_FIELDS = ["name", "description", "regions", "gpus", "gpus_per_node", "link_gbps", "models", "models.0",
               "models.0.model", "models.0.prefill_slo_ms", "models.0.decode_slo_ms", "models.0.trace",
               "models.0.rate_req_s", "models.1.rate_req_s", "availability", "availability.default_nodes",
               "availability.nodes", "templates", "templates.n_max", "templates.rho", "templates.slo_margin",
               "allocation", "allocation.headroom",
               "allocation.replan_interval_min", "allocation.node_startup_min", "extra_key", "models.0.extra"]
# Fields a plan reads but templates do not: a change keeps SMALL's library key, so no example rebuilds it.
PLAN_FIELDS = ["models.0.rate_req_s", "allocation.headroom", "availability.default_nodes", "regions",
               "allocation.replan_interval_min", "allocation.node_startup_min", "availability.nodes"]


EDGE_VALUES = [float("nan"), float("inf"), -1.0, 0, 0.5, 10**9]
EDGE = st.sampled_from(EDGE_VALUES)


def _mutated(base, fields, fewest=1, values=VALUE):
    return st.lists(st.tuples(st.sampled_from(fields), values), min_size=fewest, max_size=3).map(
        lambda changes: _apply(base, changes))


def _apply(base, changes):
    doc = base
    for dotted, value in changes:
        doc = with_field(doc, dotted, value)
    return doc


def _finite_everywhere(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite_everywhere(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite_everywhere(v) for v in value)
    return True


def _check_valid(s: sc.Scenario) -> None:
    """The scenario format's contract (the bounds in `catalog/scenarios.py`), checked on every accepted file."""
    assert s.models and s.regions and s.node_configs
    for m in s.models:
        assert 0 < m.prefill_slo_ms <= sc.MAX_SLO_MS and 0 < m.decode_slo_ms <= sc.MAX_SLO_MS
        assert 0 < m.rate_req_s <= sc.MAX_RATE_REQ_S and 0 < m.slo_margin <= 1
    assert 1 <= s.n_max <= sc.MAX_N_MAX and 1 <= s.rho <= sc.MAX_RHO and 1 <= s.headroom <= sc.MAX_HEADROOM
    assert 0 < s.replan_interval_min <= sc.MAX_MINUTES and 0 <= s.node_startup_min <= sc.MAX_MINUTES
    assert s.link_gbps is None or 0 < s.link_gbps <= sc.MAX_LINK_GBPS
    assert 0 <= s.default_nodes and all(0 <= k for _, node, k in s.available_nodes if node in s.node_configs)
    assert all(n in s.node_configs for _, n, _ in s.available_nodes)


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=_mutated(CORE, CORE_FIELDS))
def test_any_scenario_file_is_a_clear_error_or_a_valid_scenario(tmp_path, doc):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(doc))
    try:
        s = sc.load_scenario(path)
    except CoralError as exc:
        assert str(path) in str(exc) and "Fix:" in str(exc)
        event("clear error")
        return
    _check_valid(s)
    event("valid scenario")


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200))
def test_any_file_text_is_a_clear_error_or_a_valid_scenario(tmp_path, text):
    path = tmp_path / "s.yml"
    path.write_text(text)
    try:
        _check_valid(sc.load_scenario(path))
    except CoralError as exc:
        assert str(path) in str(exc)


@pytest.fixture(scope="module")
def small_db(tmp_path_factory, small_library):
    """SMALL's template library built once into a DuckDB file of its own."""
    folder = tmp_path_factory.mktemp("props")
    return folder, copy_small(small_library, folder)[1]


FLOAT_TEXT = st.one_of(st.floats(0.0, 3.0).map(repr), st.floats(0.0, 3.0).map(repr),
                       st.floats(allow_nan=True, allow_infinity=True).map(repr),
                       st.sampled_from(["nan", "inf", "-inf", "NaN", "1e400", "-0", "0", "1", "0.5", "abc", ""]))


def _strict_json(text: str):
    def refuse(name):
        raise AssertionError(f"{name} in JSON output")

    return json.loads(text[text.index("{"):], parse_constant=refuse)


def _plan_run(db, path, doc, scarcity="none", scale=None, limit=None) -> str:
    """Run `coral plan` on `doc`; assert a clear error or a finite plan that is what it says; returns the outcome."""
    path.write_text(yaml.safe_dump(doc))
    # The closed loop (on by default) re-plans after simulating; what is checked here is the inputs' path alone.
    args = ["plan", "--scenario", str(path), "--no-store", "--no-closed-loop", "--json", "--db", str(db),
            "--scarcity", scarcity]
    args += ["--availability-scale", scale] if scale is not None else []
    args += ["--time-limit-s", limit] if limit is not None else []
    res = CliRunner().invoke(main, args)
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    if res.exit_code != 0:
        assert res.exit_code == 2 and ("error:" in res.output or "Invalid value" in res.output), res.output
        return "clear error"
    out = _strict_json(res.output)
    assert _finite_everywhere(out)
    assert math.isclose(out["cost_usd_per_hour"], sum(i["usd_per_hour"] for i in out["instances"]),
                        rel_tol=1e-9, abs_tol=1e-9)
    assert all(isinstance(i["count"], int) and i["count"] >= 1 for i in out["instances"])
    served = out["served"]
    assert set(served) == {"phi-4/prefill", "phi-4/decode"}
    assert all(isinstance(v["demand_tokens_per_s"], float) and v["demand_tokens_per_s"] > 0 for v in served.values())
    if out["status"] == "optimal" and scarcity == "none":  # an optimal plan serves all the demand
        assert all(v["served_tokens_per_s"] >= v["demand_tokens_per_s"] * (1 - 1e-9) for v in served.values())
    return "plan"


@settings(max_examples=50, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=_mutated(SMALL, PLAN_FIELDS, fewest=0, values=st.one_of(VALUE, EDGE)),
       scale=st.one_of(st.none(), st.just("1"), FLOAT_TEXT), limit=st.one_of(st.none(), st.none(), FLOAT_TEXT),
       scarcity=st.sampled_from(["none", "scale", "fair"]))
def test_plan_of_any_scenario_and_floats_is_a_clear_error_or_finite_json(small_db, doc, scale, limit, scarcity):
    folder, db = small_db
    event(_plan_run(db, folder / "case.yaml", doc, scarcity, scale, limit))


@pytest.mark.parametrize("value", EDGE_VALUES, ids=repr)
@pytest.mark.parametrize("dotted", PLAN_FIELDS)
def test_plan_of_every_edge_value_in_every_plan_field(small_db, dotted, value):
    # The grid beside the search: each plan field at each edge value (NaN rates once made an "optimal" plan
    # serving nothing, headroom 0 a "$0.00/h optimal" one).
    folder, db = small_db
    _plan_run(db, folder / "grid.yaml", with_field(SMALL, dotted, value))


@settings(max_examples=300, derandomize=True)
@given(text=FLOAT_TEXT, low=st.one_of(st.none(), st.floats(-5, 5)), high=st.one_of(st.none(), st.floats(5, 50)),
       low_open=st.booleans())
def test_finite_float_accepts_exactly_the_finite_numbers_in_range(text, low, high, low_open):
    import click

    from coral_dagster.cli._out import FiniteFloat

    try:  # the oracle: Python's own float parsing and the stated interval
        x = float(text)
        ok = math.isfinite(x) and (low is None or (x > low if low_open else x >= low)) and (high is None or x <= high)
    except ValueError:
        ok = False
    try:
        got = FiniteFloat(low, high, low_open=low_open).convert(text, None, None)
    except click.BadParameter as exc:
        assert not ok and repr(text) in str(exc)
        return
    assert ok and got == float(text)


def _commands(group, prefix=()):
    """Every command under a group (the `coral` group loads its commands on demand, so ask it for each)."""
    import click

    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*prefix, name))
        else:
            yield (*prefix, name), cmd


def test_every_float_option_of_the_cli_is_finite_checked():
    import click

    from coral_dagster.cli._out import FiniteFloat

    params = [(" ".join(path), p.name, p.type) for path, cmd in _commands(main) for p in cmd.params]
    plain = [(cmd, name) for cmd, name, kind in params if isinstance(kind, click.types.FloatParamType)]
    checked = [(cmd, name) for cmd, name, kind in params if isinstance(kind, FiniteFloat)]
    assert plain == [] and len(checked) >= 20, (plain, checked)
