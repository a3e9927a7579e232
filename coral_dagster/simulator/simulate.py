"""Simulate an allocation plan under a scenario's traffic: the one call the CLI and benchmarks make."""

from __future__ import annotations

from typing import Mapping

from coral_dagster.allocation.types import Plan
from coral_dagster.catalog.scenarios import Scenario, load_scenario
from coral_dagster.errors import UnknownNameError
from coral_dagster.simulator.engine import Engine, SimConfig
from coral_dagster.simulator.latency import LatencyModel, ProfileLatencyModel
from coral_dagster.simulator.result import ModelSlo, SimResult, build_result
from coral_dagster.catalog.traces import trace_names
from coral_dagster.simulator.workload import Arrivals, ModelLoad, make_workload

TRAFFIC = ("scenario", "azure-conv", "azure-code", "poisson", "gamma")


def simulate_plan(plan: Plan, scenario: Scenario | str, *, trace: str | None = None, duration_s: float = 600.0,
                  seed: int = 0, rate_scale: float = 1.0, gamma_cv: float = 2.0,
                  latency: LatencyModel | None = None, config: SimConfig = SimConfig(),
                  rates: Mapping[str, float] | None = None) -> SimResult:
    """Serve the scenario's models at `rate_scale` × their rates for `duration_s` seconds on `plan`.

    `rates` overrides the request rate (req/s) of the models it names, e.g. the rates a plan was made for under
    a demand mix, a scarcity factor or a re-plan window; the others keep the scenario's rate.

    `trace`: None or "scenario" replays each model's own trace scaled to its rate; "azure-conv" / "azure-code"
    replays that trace for every model; "poisson" / "gamma" (coefficient of variation `gamma_cv`) draw arrivals
    and take request lengths from each model's trace. `latency` defaults to the profile performance model.
    """
    scn = load_scenario(scenario) if isinstance(scenario, str) else scenario
    traffic = trace or "scenario"
    if traffic not in TRAFFIC:
        raise UnknownNameError("trace", traffic, TRAFFIC)
    arrivals: Arrivals = "poisson" if traffic == "poisson" else "gamma" if traffic == "gamma" else "trace"
    base = {m.model: m.rate_req_s for m in scn.models}
    if rates is not None:
        unknown = sorted(set(rates) - set(base))
        if unknown:
            raise UnknownNameError("model", unknown[0], tuple(base))
        base.update(rates)
    loads = [ModelLoad(m.model, traffic if traffic in trace_names() else m.trace, base[m.model] * rate_scale)
             for m in scn.models]
    workload = make_workload(loads, duration_s, seed, arrivals, gamma_cv)
    engine = Engine(plan, workload, latency or ProfileLatencyModel(), config=config, link_gbps=scn.link_gbps)
    out = engine.run()
    slos = {m.model: ModelSlo(m.model, m.prefill_slo_ms, m.decode_slo_ms) for m in scn.models}
    label = f"gamma(cv={gamma_cv:g})" if traffic == "gamma" else traffic
    cost = sum(pi.count * pi.usd_per_hour for pi in plan.instances)
    return build_result(out, workload, slos, scenario=scn.name, method=plan.method, arrivals=label, seed=seed,
                        rate_scale=rate_scale, cost_usd_per_hour=cost)


def goodput_estimator(scenario: Scenario | str, *, trace: str | None = None, duration_s: float = 600.0,
                      seed: int = 0, latency: LatencyModel | None = None, rates: Mapping[str, float] | None = None):
    """An `allocation.goodput.GoodputEstimator` that simulates the plan at the scenario's full demand, or at
    `rates` (req/s per model, without the planning headroom) where given.

    fraction = goodput over offered tokens/s; per_model = each model's SLO attainment. The headroom argument of
    the estimator signature is not needed: the simulation serves the actual request rates.
    """
    from coral_dagster.allocation.goodput import Goodput

    def estimate(plan: Plan, headroom: float = 1.0) -> Goodput:
        res = simulate_plan(plan, scenario, trace=trace, duration_s=duration_s, seed=seed, latency=latency,
                            rates=rates)
        offered = res.offered_tokens_per_s
        return Goodput(res.goodput_tokens_per_s, res.goodput_tokens_per_s / offered if offered else 1.0,
                       res.attainment_by_model, "simulated")

    return estimate
