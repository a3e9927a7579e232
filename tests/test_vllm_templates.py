"""Engine-aware templates: vLLM's filter against a brute-force layout of vLLM's multiprocessing ranks."""

from __future__ import annotations

import itertools

import pytest

from coral_dagster import paths
from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.errors import CatalogError, CoralError
from coral_dagster.templates.engines import runnable, vllm_violations
from coral_dagster.templates.types import Stage, Template

NODES = [NodeConfig("L4", 1), NodeConfig("L40S", 1), NodeConfig("A10G", 2), NodeConfig("L4", 2)]


def _template(stages: list[list[NodeConfig]], phase: str = "aggregated") -> Template:
    out, start = [], 0
    for nodes in stages:
        out.append(Stage(start, start + 2, tuple(nodes), tuple(1 / len(nodes) for _ in nodes)))
        start += 2
    return Template("phi-4", phase, 60.0, NodeMultiset.of([n for s in stages for n in s]), tuple(out), 1.0,
                    "compute")


def _vllm_can_lay_out(t: Template) -> bool:
    """Brute force over vLLM's layout: `nnodes` nodes in template order, `tp * pp` ranks, rank r on node
    r // ranks_per_node and in stage r // tp; the template runs when some tp puts every stage on one node and
    uses exactly each node's GPUs (tensor parallelism across nodes is not the load split a stage's nodes do). Only
    aggregated instances run (no KV connector between vLLM instances)."""
    if t.phase != "aggregated":
        return False
    nodes = [n for s in t.stages for n in s.nodes]
    stage_of_node = [i for i, s in enumerate(t.stages) for _ in s.nodes]
    pp = len(t.stages)
    for tp in (1, 2, 4, 8):
        world = tp * pp
        if world % len(nodes):
            continue
        per_node = world // len(nodes)
        placed = [(r // per_node, r // tp) for r in range(world)]
        one_node = all(len({node for node, st in placed if st == s}) == 1 for s in range(pp))
        if one_node and all(per_node == n.count for n in nodes) and all(
                stage_of_node[node] == stage for node, stage in placed):
            return True
    return False


def _all_small_templates():
    for n_stages in (1, 2, 3):
        for sizes in itertools.product((1, 2), repeat=n_stages):
            pool = itertools.product(NODES, repeat=sum(sizes))
            for flat in itertools.islice(pool, 40):
                it = iter(flat)
                stages = [[next(it) for _ in range(k)] for k in sizes]
                for phase in ("aggregated", "prefill"):
                    yield _template(stages, phase)


def test_vllm_filter_matches_brute_force_layout():
    templates = list(_all_small_templates())
    kept = runnable("vllm-aggregated", templates)  # the brute force lays out instances without a KV connector
    assert [t for t in templates if _vllm_can_lay_out(t)] == list(kept)
    assert 0 < len(kept) < len(templates)
    assert runnable("coral", templates) == tuple(templates)


def test_violations_name_each_rule():
    bad = _template([[NODES[0], NODES[1]], [NODES[2]]], phase="decode")
    rules = [v.split(":")[0] for v in vllm_violations(bad)]
    assert rules == ["V1", "V2", "V3"]
    assert vllm_violations(_template([[NODES[0]], [NODES[1]]])) == ()


def test_engine_setting_is_validated(tmp_path):
    with pytest.raises(CoralError, match="use one of: coral, vllm"):
        runnable("trt", [])
    src = tmp_path / "x.yaml"
    core = (paths.SCENARIOS_DIR / "core.yaml").read_text()
    src.write_text(core + "engine: sglang\n")
    with pytest.raises(CatalogError, match="engine"):
        load_scenario(src)
    src.write_text(core + "engine: vllm\n")
    assert load_scenario(src).engine == "vllm" and load_scenario("core").engine == "coral"
