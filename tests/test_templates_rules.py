"""The two T̂ rules side by side: the paper's per-stage rule against a hand-computed two-node pipeline, and the
rule as a scenario and CLI setting with libraries keyed apart."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import yaml
from click.testing import CliRunner

from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.cli.main import main
from coral_dagster.errors import CatalogError, CoralError
from coral_dagster.templates.best import best_template
from coral_dagster.templates.throughput import Workload, build_tables
from support.perf_points import Pt

FAST, SLOW = NodeConfig("L40S", 1), NodeConfig("L4", 1)
# Per-layer latency model: decode step of b sequences costs ALPHA + BETA·b ms per layer; memory in made-up units:
# a layer's weights take W, a KV token of one layer takes KV, the node holds MEM.
ALPHA = {FAST: 0.10, SLOW: 0.30}
BETA = {FAST: 0.004, SLOW: 0.012}
MEM = {FAST: 48.0, SLOW: 24.0}
W, KV = 0.5, 2e-5
PROMPT, OUTPUT = 1000, 200
CONTEXT = PROMPT + OUTPUT // 2  # `Workload.decode_context_tokens`


class AffinePerf:
    """A reference perf model over the affine per-layer latency above: T̂ by scanning every batch size."""

    def max_layers(self, model, node) -> int:
        return int(MEM[node] // W) - 1

    def kv_capacity_tokens(self, model, node, layers) -> int:
        return int((MEM[node] - W * layers) / (KV * layers))

    def t_hat(self, model, node, phase, layers, budget_ms, context_tokens=0, send_gbps=None, *,
              resident_batches=1):
        send_ms = 0.0 if send_gbps is None else 0.01  # any activation charge changes the answer
        best = Pt(0.0, 0, 0.0, "slo")
        b = 1
        while True:
            ms = layers * (ALPHA[node] + BETA[node] * b) + send_ms * b
            if ms > budget_ms or b * context_tokens * resident_batches > self.kv_capacity_tokens(model, node, layers):
                return best
            best = Pt(b * 1000.0 / ms, b, ms, "compute")
            b += 1


def paper_t_hat(node: NodeConfig, layers: int, slo_ms: float, stages: int) -> float:
    """Closed form of the paper's T̂: the largest batch within ℓ/S (ALPHA + BETA·b per layer) and within the KV room
    left after the weights for one batch of CONTEXT-token sequences, at its own throughput."""
    by_time = math.floor((slo_ms / stages / layers - ALPHA[node]) / BETA[node])
    by_kv = math.floor((MEM[node] - W * layers) / (KV * layers) / CONTEXT)
    b = min(by_time, by_kv)
    return 0.0 if b < 1 else b * 1000.0 / (layers * (ALPHA[node] + BETA[node] * b))


def test_paper_rule_matches_the_closed_form_on_a_two_node_pipeline():
    slo_ms, n_layers = 60.0, 40  # phi-4: 40 layers
    # A 0.5 margin, a slow link and a trace would all lower the slo rule's T̂; the paper rule ignores them.
    w = Workload("phi-4", "decode", slo_ms, PROMPT, OUTPUT, 1200.0, link_gbps=1.0, slo_margin=0.5,
                 trace="azure-conv", max_context_tokens=10**6, rule="paper")
    tables = build_tables(w, (SLOW, FAST), 2, AffinePerf())
    t = best_template(tables, NodeMultiset.of([SLOW, FAST]))
    # The oracle: two stages (each node alone holds at most 95 / 47 layers, so both stages are needed or one
    # suffices; one stage gets ℓ, two get ℓ/2 each), every split j / 40 − j in both orders.
    splits = {(a, j): min(paper_t_hat(a, j, slo_ms, 2), paper_t_hat(b, n_layers - j, slo_ms, 2))
              for a, b in ((FAST, SLOW), (SLOW, FAST)) for j in range(1, n_layers)}
    two = max(splits.values())
    one = max(paper_t_hat(FAST, n_layers, slo_ms, 1), paper_t_hat(SLOW, n_layers, slo_ms, 1))
    assert two > one > 0 and t.tokens_per_s == pytest.approx(two, rel=1e-12)
    # T̂ does not depend on a stage's position, so either order of an optimal split may come back.
    assert len(t.stages) == 2 and splits[(t.stages[0].nodes[0], t.stages[0].layers)] == two
    # The slo rule on the same inputs plans below it (margin, two batches of KV, activation charge).
    slo = build_tables(dataclasses.replace(w, rule="slo"), (SLOW, FAST), 2, AffinePerf())
    for s in (1, 2):
        assert slo.tokens_per_s[s].max() < tables.tokens_per_s[s].max()


@pytest.mark.parametrize("stages", [1, 2])
def test_paper_table_entries_are_the_closed_form(stages):
    w = Workload("phi-4", "decode", 60.0, PROMPT, OUTPUT, 1200.0, slo_margin=0.7, rule="paper")
    tables = build_tables(w, (SLOW, FAST), 2, AffinePerf())
    for node in (SLOW, FAST):
        for j in (1, 7, 20, 40):
            assert tables.point(stages, node, j).tokens_per_s == pytest.approx(paper_t_hat(node, j, 60.0, stages))
    assert tables.budget_ms(stages) == 60.0 / stages


def test_paper_aggregated_step_holds_both_slos_on_the_shipped_model():
    from coral_dagster.catalog.scenarios import load_scenario
    from coral_dagster.templates.throughput import workload_for

    scn = load_scenario("core")
    w = workload_for(scn.model("phi-4"), "aggregated", scn.link_gbps, rule="paper")
    node = NodeConfig("L40S", 2)
    tables = build_tables(w, (node,), 2)
    for s in (1, 2):
        p = tables.point(s, node, 40 // s)
        assert p.tokens_per_s > 0 and p.stage_ms <= w.slo_ms / s
        # Output tokens per step can beat neither the decode batch nor the prompt tokens' share (× D/P).
        share = w.output_tokens / (w.prompt_tokens + w.output_tokens)
        assert p.tokens_per_s * p.stage_ms / 1000.0 <= p.batch * share + 1e-9


def _write(tmp_path, rule) -> str:
    doc = yaml.safe_load(open(load_scenario("core").path))
    doc["templates"] = {**(doc.get("templates") or {}), "t_hat_rule": rule}
    path = tmp_path / f"core-{rule}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_rule_is_a_scenario_setting_keyed_apart(tmp_path):
    core = load_scenario("core")
    assert core.t_hat_rule == "slo"
    slo, paper = load_scenario(_write(tmp_path, "slo")), load_scenario(_write(tmp_path, "paper"))
    assert slo.t_hat_rule == "slo" and paper.t_hat_rule == "paper"
    # Saying `slo` is saying nothing: the default's key is the key libraries had before rules were chosen.
    assert slo.library_key == core.library_key and paper.library_key != core.library_key
    assert dataclasses.replace(core, t_hat_rule="paper").library_key == paper.library_key
    with pytest.raises(CatalogError, match="t_hat_rule.*unknown T̂ rule 'papers'.*paper, slo"):
        load_scenario(_write(tmp_path, "papers"))
    with pytest.raises(CoralError, match="T̂ rule"):
        Workload("phi-4", "decode", 60, 10, 10, 100, rule="fast")


def test_cli_best_and_profile_take_the_rule():
    base = ["templates", "best", "--model", "phi-4", "--phase", "decode", "--nodes", "1xL40S:2", "--scenario", "core",
            "--json"]
    out = {}
    for rule in ("paper", "slo"):
        res = CliRunner().invoke(main, base + ["--t-hat-rule", rule])
        assert res.exit_code == 0, res.output
        out[rule] = json.loads(res.output)
        assert out[rule]["t_hat_rule"] == rule
    assert out["paper"]["stage_budget_ms"] == 60.0 and out["slo"]["stage_budget_ms"] < 60.0  # core's margin
    assert out["paper"]["tokens_per_s"] > out["slo"]["tokens_per_s"]
    res = CliRunner().invoke(main, ["profile", "throughput", "--model", "phi-4", "--node", "L40S:2", "--phase",
                                    "decode", "--layers", "40", "--budget-ms", "60", "--send-gbps", "10",
                                    "--t-hat-rule", "paper"])
    assert res.exit_code != 0 and "charges no activation transfer" in res.output


def test_list_reaches_the_rule_s_library(tmp_path):
    res = CliRunner().invoke(main, ["templates", "list", "--scenario", "core", "--t-hat-rule", "paper", "--db",
                                    str(tmp_path / "empty.duckdb")])
    assert res.exit_code != 0 and "no template library" in res.output
