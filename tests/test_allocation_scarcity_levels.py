"""Uniform and max-min fair levels against water-filling's closed form, also when some level solves are cut short
(a time limit answers 0, as `IlpReach` does for a solve with no incumbent)."""

from __future__ import annotations

import numpy as np
import pytest

from coral_dagster.allocation.scarcity import fair_levels, uniform_levels


def budget_oracle(need: dict[str, float], budget: float, cap: dict[str, float]):
    """One shared budget: serving model m at level x costs need[m]·x, and m reaches at most cap[m]. The free models'
    common level is what the budget left by the held ones buys, within every free model's cap."""

    def reach(held, free):
        left = budget - sum(need[m] * v for m, v in held.items())
        if left < -1e-12:
            return 0.0
        return max(0.0, min([1.0, left / sum(need[m] for m in free)] + [cap[m] for m in free]))

    return reach


def water_filling(need, budget, cap) -> dict[str, float]:
    """Max-min fair levels of the budget problem: raise everyone, freeze the capped ones, repeat."""
    level, free, left = {}, sorted(need), budget
    while free:
        t = min(1.0, left / sum(need[m] for m in free))
        capped = [m for m in free if cap[m] <= t]
        if not capped:
            level.update({m: t for m in free})
            break
        for m in capped:
            level[m] = cap[m]
            left -= need[m] * cap[m]
        free = [m for m in free if m not in capped]
    return level


class Flaky:
    """`reach`, answering 0 on the call numbers in `fail_calls` (a time-out without an incumbent); `proven()` says
    whether the last answer was a real one."""

    def __init__(self, reach, fail_calls):
        self.reach, self.fail_calls, self.calls, self.last_proven = reach, fail_calls, 0, True

    def __call__(self, held, free):
        self.last_proven = self.calls not in self.fail_calls
        self.calls += 1
        return self.reach(held, free) if self.last_proven else 0.0

    def proven(self) -> bool:
        return self.last_proven


def instance(seed: int):
    rng = np.random.default_rng(seed)
    models = [f"m{k}" for k in range(int(rng.integers(2, 5)))]
    need = {m: float(rng.uniform(1, 10)) for m in models}
    cap = {m: float(rng.choice([1.0, rng.uniform(0.05, 0.6)])) for m in models}
    return models, need, float(rng.uniform(0.2, 0.9)) * sum(need.values()), cap


@pytest.mark.parametrize("seed", range(12))
def test_fair_levels_equal_water_filling(seed):
    models, need, budget, cap = instance(seed)
    got = fair_levels(models, budget_oracle(need, budget, cap))
    assert got == pytest.approx(water_filling(need, budget, cap), abs=1e-9)


@pytest.mark.parametrize("seed", range(12))
def test_a_first_level_solve_cut_short_does_not_zero_the_uniform_level(seed):
    """The uniform level is the largest all reach together (min over caps and budget / total need); a first solve
    that answers 0 must not leave every model at 0 when fair share finds them all a positive level."""
    models, need, budget, cap = instance(seed)
    exact = min([1.0, budget / sum(need.values())] + list(cap.values()))
    oracle = Flaky(budget_oracle(need, budget, cap), {0})
    got = uniform_levels(models, oracle, oracle.proven)
    assert min(got.values()) == pytest.approx(exact, abs=1e-9)
    assert len(set(got.values())) == 1


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("fail", [0, 1, 2, 3, 4])
def test_a_solve_cut_short_leaves_no_model_below_what_it_reaches(seed, fail):
    """Whichever one solve of the progressive filling times out, every model ends at least at the level it reaches
    with every other held at theirs (Pareto for the exact oracle); when the timed-out solve is a model's room (not
    the first common level, which `uniform_levels` covers), no model ends at 0."""
    models, need, budget, cap = instance(seed)
    exact = budget_oracle(need, budget, cap)
    oracle = Flaky(exact, {fail})
    got = fair_levels(models, oracle, oracle.proven)
    for m in models:
        assert got[m] >= exact({o: v for o, v in got.items() if o != m}, [m]) - 1e-9
    if fail > 0:
        assert min(got.values()) > 0
