"""The re-plan decision, checked case by case against the rule it states."""

from __future__ import annotations

import itertools

from coral_dagster.reallocation import PlanState, decide_replan

DEMAND = {("phi-4", "prefill"): 1000.0, ("phi-4", "decode"): 200.0}
AVAIL = {("aws:us-east-2", "L4:1"): 10}


def _state(prefill=1000.0, decode=200.0, used=4, cost=10.0):
    return PlanState("p1", {("phi-4", "prefill"): prefill, ("phi-4", "decode"): decode},
                     {("aws:us-east-2", "L4:1"): used}, cost)


def test_no_plan_means_replan():
    assert decide_replan(None, DEMAND, AVAIL).replan


def test_steady_state_keeps_the_plan():
    d = decide_replan(_state(), DEMAND, AVAIL, candidate_cost_usd_per_hour=9.9, churn_usd_per_hour=0.0)
    assert not d.replan and d.reasons == ()


def test_each_trigger_alone_and_all_combinations():
    """Exhaustive over the three triggers: re-plan iff at least one fires, with one reason per trigger."""
    for short, shrunk, cheaper in itertools.product([False, True], repeat=3):
        state = _state(prefill=900.0 if short else 1000.0)
        avail = {("aws:us-east-2", "L4:1"): 3 if shrunk else 10}
        d = decide_replan(state, DEMAND, avail, candidate_cost_usd_per_hour=7.0 if cheaper else 9.8,
                          churn_usd_per_hour=1.0, savings_threshold=0.05)
        assert d.replan == (short or shrunk or cheaper)
        assert len(d.reasons) == short + shrunk + cheaper


def test_saving_smaller_than_churn_does_not_replan():
    d = decide_replan(_state(cost=10.0), DEMAND, AVAIL, candidate_cost_usd_per_hour=8.0, churn_usd_per_hour=1.6,
                      savings_threshold=0.05)
    assert not d.replan  # saves 0.4 $/h = 4% < 5%
    d = decide_replan(_state(cost=10.0), DEMAND, AVAIL, candidate_cost_usd_per_hour=8.0, churn_usd_per_hour=1.4,
                      savings_threshold=0.05)
    assert d.replan  # saves 0.6 $/h = 6%
