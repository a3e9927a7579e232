"""One serving template alone in the simulator at a share of its T̂, Poisson arrivals: the SLO attainment it gets."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coral_dagster.allocation.types import Plan, PlannedInstance
from coral_dagster.catalog.models import get_model
from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.catalog.scenarios import Scenario
from coral_dagster.catalog.traces import trace_means
from coral_dagster.errors import CoralError
from coral_dagster.simulator.engine import OK, Engine, SimConfig
from coral_dagster.simulator.latency import ConstantStage, LatencyModel, ProfileLatencyModel, StageLatency
from coral_dagster.simulator.workload import ModelLoad, make_workload
from coral_dagster.templates.types import Stage, Template

#: Nodes of the instant prefill instance that feeds a decode template (the first its template does not use).
_FEEDER_NODES = ("H200:8", "H100:8")
_REGION = "reach"


@dataclass(frozen=True)
class Reach:
    """What one template reached: requests served within its SLO at `load` × T̂ (tokens/s of its phase)."""

    template_id: str
    model: str
    phase: str
    stages: int
    mixed_gpus: bool
    nodes: str
    tokens_per_s: float
    load: float
    rate_req_s: float
    requests: int
    attainment: float
    ttft_p99_ms: float
    tpot_p99_ms: float
    seed: int


class _WithFeeder:
    """The profile latency model, but the feeder's nodes prefill and decode in a microsecond with unbounded KV (and,
    given to the engine as `node_gbps`, an unbounded link: it stands for a whole prefill fleet)."""

    def __init__(self, inner: LatencyModel, feeder: NodeConfig) -> None:
        self.inner, self.feeder = inner, feeder

    def stage(self, model: str, node: NodeConfig, layers: int) -> StageLatency:
        if node == self.feeder:
            return ConstantStage(1e-3, 1e-3, float("inf"))
        return self.inner.stage(model, node, layers)


def _feeder(template: Template, n_layers: int) -> Template:
    used = set(template.nodes.as_dict())
    node = next(NodeConfig.parse(n) for n in _FEEDER_NODES if NodeConfig.parse(n) not in used)
    return Template(template.model, "prefill", 1.0, NodeMultiset.of([node]), (Stage(0, n_layers, (node,), (1.0,)),),
                    1.0, "compute")


def template_reach(template: Template, scenario: Scenario, *, load: float = 0.95, seed: int = 0,
                   min_requests: int = 1500, min_duration_s: float = 120.0, latency: LatencyModel | None = None,
                   config: SimConfig = SimConfig()) -> Reach:
    """Simulate one instance of `template` alone at `load` × its T̂ with Poisson arrivals and its model's trace
    lengths, long enough for `min_requests` arrivals.

    A prefill template meets its SLO when its first token comes within the prefill SLO; a decode one, fed by an
    instant prefill instance in the same region (its KV cache still crosses the network), when its mean TPOT is
    within the decode SLO; an aggregated one when both hold. Requests refused or unfinished miss.
    """
    if not 0 < load:
        raise CoralError(f"load {load:g} of T̂.", "give a positive share, e.g. 0.95.")
    sm = scenario.model(template.model)
    prompt, output = trace_means(sm.trace)
    per_request = prompt if template.phase == "prefill" else output
    rate = load * template.tokens_per_s / per_request
    if rate <= 0:
        raise CoralError(f"template {template.template_id} has no throughput to load.", "pick one with T̂ > 0.")
    duration_s = max(min_duration_s, min_requests / rate)
    workload = make_workload([ModelLoad(template.model, sm.trace, rate)], duration_s, seed, "poisson")
    base = latency or ProfileLatencyModel()
    instances = [PlannedInstance(template, _REGION, 1, 0.0)]
    node_gbps = {}
    if template.phase == "decode":
        feeder = _feeder(template, get_model(template.model).n_layers)
        instances.append(PlannedInstance(feeder, _REGION, 1, 0.0))
        base = _WithFeeder(base, feeder.stages[0].nodes[0])
        node_gbps = {feeder.stages[0].nodes[0]: float("inf")}
    # A hand-made one-instance plan run as Coral runs its plans (the engine reads no plan's method).
    plan = Plan(scenario.name, "coral", "optimal", 0.0, 0.0, 0.0, 0.0, tuple(instances), {}, {})
    out = Engine(plan, workload, base, config=config, link_gbps=scenario.link_gbps, node_gbps=node_gbps).run()
    ttft_ms = (out.ttft_s - workload.arrival_s) * 1000.0
    decode_tokens = np.maximum(workload.output_tokens - 1, 1)
    tpot_ms = np.where(workload.output_tokens > 1, (out.finish_s - out.ttft_s) * 1000.0 / decode_tokens, 0.0)
    done = out.status == OK
    ttft_ok = ttft_ms <= sm.prefill_slo_ms  # NaN (never prefilled) compares False
    tpot_ok = done & (tpot_ms <= template.slo_ms)
    met = ttft_ok if template.phase == "prefill" else tpot_ok if template.phase == "decode" else ttft_ok & tpot_ok
    gpus = {n.gpu for n in template.nodes.as_dict()}
    return Reach(template.template_id, template.model, template.phase, len(template.stages), len(gpus) > 1,
                 str(template.nodes), template.tokens_per_s, load, rate, len(workload),
                 float(met.mean()) if len(workload) else 1.0,
                 float(np.nanpercentile(ttft_ms, 99)) if np.isfinite(ttft_ms).any() else float("nan"),
                 float(np.nanpercentile(np.where(done, tpot_ms, np.nan), 99)) if done.any() else float("nan"), seed)
