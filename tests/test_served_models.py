"""Served models (a fine-tune served under its own name over a catalog base): parsing, errors, shared templates,
and plans and simulations that match the base served under its own name."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from coral_dagster.allocation.inputs import scenario_problem
from coral_dagster.allocation.methods import make_plan
from coral_dagster.catalog.models import get_model
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.errors import CatalogError, UnknownNameError
from coral_dagster.simulator.simulate import simulate_plan
from coral_dagster.templates import library
from coral_dagster.templates.library import build_library, build_library_with_stats

HEAD = """name: served
regions: [aws:us-east-2]
gpus: [L4, A10G, L40S]
gpus_per_node: [1, 4]
templates: {n_max: 2}
availability: {default_nodes: 64}
models:
"""


def _scenario(tmp_path, rows: str, name: str = "s.yaml"):
    path = tmp_path / name
    path.write_text(HEAD + rows)
    return load_scenario(path)


def test_a_served_model_is_its_own_model_with_its_bases_architecture(tmp_path):
    scn = _scenario(tmp_path, """
  - {model: phi-4, prefill_slo_ms: 1200, decode_slo_ms: 60, trace: azure-conv, rate_req_s: 2}
  - {model: phi-4-support-t1, base: phi-4, prefill_slo_ms: 900, decode_slo_ms: 50, trace: azure-code, rate_req_s: 3}
""")
    plain, served = scn.models
    assert (plain.model, plain.base) == ("phi-4", "phi-4")
    assert (served.model, served.base, served.rate_req_s, served.trace) == ("phi-4-support-t1", "phi-4", 3.0,
                                                                           "azure-code")
    assert get_model("phi-4-support-t1") is get_model("phi-4")
    assert scn.model("phi-4-support-t1") is served


def test_a_fresh_process_knows_the_served_models_of_bundled_scenarios():
    first = next(m for m in load_scenario("mega").models if m.base != m.model)
    code = f"from coral_dagster.catalog.models import get_model; print(get_model({first.model!r}).alias)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == first.base


@pytest.mark.parametrize("row, field, words", [
    ("{model: phi-4-ft-t2, base: phi-5, ", "base", "phi-5"),  # unknown base
    ("{model: qwen3-32b, base: phi-4, ", "base", "name of a catalog model"),  # shadows a catalog alias
    ("{model: QWEN3-32B, base: phi-4, ", "base", "name of a catalog model"),  # names match case-insensitively
    ("{model: phi-4-ft-t3, base: phi-4-support-t1, ", "base", "phi-4-support-t1"),  # a base must be a catalog model
    ("{model: phi-4 ft, base: phi-4, ", "model", "not a served model name"),
    ("{model: phi-4-unknown-t4, ", "model", "base: <catalog model>"),  # unknown model, no base: say how to serve it
])
def test_bad_served_models_are_named_with_the_fix(tmp_path, row, field, words):
    _scenario(tmp_path, "  - {model: phi-4-support-t1, base: phi-4, prefill_slo_ms: 900, decode_slo_ms: 50, "
                        "trace: azure-code, rate_req_s: 3}\n", "ok.yaml")
    with pytest.raises(CatalogError) as err:
        _scenario(tmp_path, "  - " + row + "prefill_slo_ms: 900, decode_slo_ms: 50, trace: azure-conv, "
                                           "rate_req_s: 1}\n")
    assert err.value.field == field and words in str(err.value) and "Fix:" in str(err.value)


def test_one_served_name_with_two_bases_is_refused(tmp_path):
    row = "  - {{model: shared-ft-t5, base: {}, prefill_slo_ms: 900, decode_slo_ms: 50, trace: azure-conv, " \
          "rate_req_s: 1}}\n"
    _scenario(tmp_path, row.format("phi-4"), "a.yaml")
    with pytest.raises(CatalogError, match="base qwen3-32b in .*b.yaml but phi-4 in .*a.yaml"):
        _scenario(tmp_path, row.format("qwen3-32b"), "b.yaml")
    with pytest.raises(UnknownNameError):
        get_model("never-declared-t6")


def test_served_models_with_one_base_slo_and_trace_share_templates_computed_once(tmp_path, monkeypatch):
    scn = _scenario(tmp_path, """
  - {model: phi-4, prefill_slo_ms: 1200, decode_slo_ms: 60, trace: azure-conv, rate_req_s: 2}
  - {model: phi-4-chat-t7, base: phi-4, prefill_slo_ms: 1200, decode_slo_ms: 60, trace: azure-conv, rate_req_s: 5}
  - {model: phi-4-code-t7, base: phi-4, prefill_slo_ms: 1200, decode_slo_ms: 60, trace: azure-code, rate_req_s: 1}
""")
    calls = []
    task = library._key_task
    monkeypatch.setattr(library, "_key_task", lambda args: calls.append(args[0]) or task(args))
    templates, stats = build_library_with_stats(scn, processes=1)
    assert sorted(calls) == sorted((m, p) for m in ("phi-4", "phi-4-code-t7") for p in library.PHASES)
    by_model = {}
    for t in templates:
        by_model.setdefault(t.model, []).append(replace(t, model="-"))
    assert by_model["phi-4-chat-t7"] == by_model["phi-4"] and by_model["phi-4"]
    assert by_model["phi-4-code-t7"] != by_model["phi-4"]  # another trace: its own templates
    rows = stats.as_frame().set_index(["model", "phase"])
    assert set(rows.loc["phi-4-chat-t7"].computed_as) == {"phi-4"}
    assert set(rows.loc["phi-4-chat-t7"].multisets) == {0}  # nothing optimized for it
    assert (rows.loc["phi-4-chat-t7"].kept == rows.loc["phi-4"].kept).all()
    # A second build of the library under served names alone matches the one under the base.
    alone = replace(scn, models=(scn.models[1],))
    assert [replace(t, model="-") for t in build_library(alone, processes=1)] == by_model["phi-4"]


def test_a_served_model_plans_and_simulates_as_its_base_would_under_its_own_name(tmp_path):
    row = "  - {{model: {}, prefill_slo_ms: 1600, decode_slo_ms: 100, trace: azure-conv, rate_req_s: 0.5}}\n"
    base = _scenario(tmp_path, row.format("qwen3-32b"), "base.yaml")
    served = _scenario(tmp_path, row.format("qwen3-32b-legal-t8, base: qwen3-32b"), "served.yaml")
    plans = []
    for scn in (base, served):
        problem = scenario_problem(scn, tuple(build_library(scn, processes=1)), scn.market())
        plans.append(make_plan(problem, "coral", time_limit_s=30))
    p_base, p_served = plans
    assert p_base.status == p_served.status == "optimal"
    assert p_served.cost_usd_per_hour == pytest.approx(p_base.cost_usd_per_hour, rel=1e-9)
    assert {i.template.model for i in p_served.instances} == {"qwen3-32b-legal-t8"}
    assert sorted((i.region, i.count, i.template.template_id.split("|", 1)[1]) for i in p_served.instances) == \
        sorted((i.region, i.count, i.template.template_id.split("|", 1)[1]) for i in p_base.instances)
    sims = [simulate_plan(p, scn, duration_s=60.0, seed=3) for p, scn in ((p_base, base), (p_served, served))]
    assert list(sims[1].attainment_by_model) == ["qwen3-32b-legal-t8"]
    assert sims[1].attainment_by_model["qwen3-32b-legal-t8"] == sims[0].attainment_by_model["qwen3-32b"]
    assert sims[1].goodput_tokens_per_s == pytest.approx(sims[0].goodput_tokens_per_s, rel=1e-12)


def test_a_plan_file_keeps_a_served_models_name_and_checks_its_bases_layers():
    from coral_dagster.allocation.codec import plan_from_doc

    served = next(m for m in load_scenario("mega").models if m.base == "qwen3-32b" and m.model != m.base)
    row = {"model": served.model, "phase": "prefill", "region": "aws:us-east-2", "count": 1, "tokens_per_s": 100.0,
           "usd_per_hour": 1.0, "stages": [{"start": 0, "end": 64, "nodes": ["L40S:4"], "shares": [1.0]}]}
    plan = plan_from_doc({"instances": [row]})
    assert [i.template.model for i in plan.instances] == [served.model]
    short = {**row, "stages": [{"start": 0, "end": 40, "nodes": ["L40S:4"], "shares": [1.0]}]}
    with pytest.raises(CatalogError, match=f"{served.model} has 64"):
        plan_from_doc({"instances": [short]})
    with pytest.raises(CatalogError, match="unknown model 'qwen3-32b-nowhere'"):
        plan_from_doc({"instances": [{**row, "model": "qwen3-32b-nowhere"}]})


def test_a_node_without_the_planner_stack_resolves_a_bundled_served_model():
    # A GPU node installs the runtime alone (no pandas): resolving a served name must not need it.
    first = next(m for m in load_scenario("mega").models if m.base != m.model)
    code = ("import sys; sys.modules['pandas'] = None\n"
            "from coral_dagster.runtime.roles import model_layers\n"
            f"print(model_layers({first.model!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == get_model(first.base).n_layers


def test_the_library_key_follows_a_served_models_base(tmp_path):
    row = "  - {{model: legal-ft-t9, base: {}, prefill_slo_ms: 1600, decode_slo_ms: 100, trace: azure-conv, " \
          "rate_req_s: 1}}\n"
    first = _scenario(tmp_path, row.format("qwen3-32b")).library_key
    assert _scenario(tmp_path, row.format("llama-1-30b")).library_key != first  # the same file, edited
    assert _scenario(tmp_path, row.format("qwen3-32b")).library_key == first
