"""Under scarcity the admission a plan derives delivers the share it promises: offered the model's whole trace (more
than its share), the two buckets pass the admitted rate over the trace, not a burst's head alone."""

from __future__ import annotations

import numpy as np
import pytest

from coral_dagster.allocation.planner import with_admission
from coral_dagster.allocation.types import AdmissionLimits, Plan, PlannedInstance
from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.catalog.traces import load_trace
from coral_dagster.routing import Admission
from coral_dagster.templates.types import Stage, Template

L40S = NodeConfig.parse("L40S:1")
RATE_REQ_S, LOOPS = 10.0, 3


def _plan(model: str, share: float, factor: float) -> Plan:
    t = Template(model, "aggregated", 60.0, NodeMultiset.of([L40S]), (Stage(0, 40, (L40S,), (1.0,)),), 1e6,
                 "compute")
    keys = [(model, p) for p in ("prefill", "decode")]
    return Plan("one", "coral", "scaled", 1.0, 1.0, 0.0, 0.0, (PlannedInstance(t, "aws:us-east-2", 1, 1.0),),
                {k: 1.0 for k in keys}, {k: share for k in keys},
                admission=AdmissionLimits({k: factor for k in keys}))


def _replayed(trace: str) -> np.ndarray:
    """LOOPS loops of the trace's arrivals time-scaled to RATE_REQ_S (a loop: its span plus one mean gap)."""
    t = load_trace(trace).arrival_s.to_numpy(dtype=float)
    period = t[-1] + (t[-1] - t[0]) / (len(t) - 1)
    return np.concatenate([t + k * period for k in range(LOOPS)]) * (len(t) / period / RATE_REQ_S)


@pytest.mark.slow
@pytest.mark.parametrize("model, share, factor", [("phi-4", 0.54, 1.0), ("gpt-oss-20b", 0.54, 1.0),
                                                  ("gpt-oss-20b", 0.3, 1.1)])
def test_the_derived_buckets_pass_the_admitted_rate_of_a_stream_over_its_share(model, share, factor):
    """The plan's capacity carries its admitted rate and no more (capacity factor `factor` ≈ 1), the fluid rule
    cannot fit any burst: the buckets still pass, of the whole trace offered at the plan's rate (1/share times the
    admitted rate), at least 95% of the admitted rate × the time it spans, and never more than the network calculus
    bound of the first bucket (its depth + rate × time). A second bucket one request deep at the admitted rate
    passes about 1/(1 + share) of it (a request's token is lost while the bucket stands full), so it fails this."""
    m = next(x for x in load_scenario("core").models if x.model == model)
    adm = with_admission(_plan(model, share, factor), {model: RATE_REQ_S}, [m]).admission
    rate, depth = adm.admit_req_s[model], adm.admit_depth_req[model]
    arrival = _replayed(m.trace)
    span_s = float(arrival[-1] - arrival[0])
    admitted = sum(Admission(adm.admit_req_s, adm.admit_depth_req, adm.admit_peak).admits(model, arrival.tolist()))
    assert admitted <= depth + rate * span_s + 1.0
    assert admitted >= 0.95 * rate * span_s, (admitted, rate * span_s, adm.admit_peak[model])
    shallow = Admission(adm.admit_req_s, adm.admit_depth_req, {model: (rate, 1.0)})
    assert sum(shallow.admits(model, arrival.tolist())) < 0.9 * rate * span_s
