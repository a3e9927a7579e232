"""The share bucket of `routing.Admission` against a brute-force counting model: which requests of random arrival
streams it admits, alone and behind a second (time-refilled) bucket, written as counts over every earlier stretch
of the stream instead of as a running credit."""

from __future__ import annotations

import numpy as np
import pytest

from coral_dagster.routing import Admission

TOLERANCE = 1e-9  # credit within this of a whole request takes it (the float sum of shares)
SEEDS = (0, 1, 2, 3, 4, 5, 6, 7)


def _counting(arrival_s: list[float], share: float, depth: float,
              peak: tuple[float, float] | None) -> list[bool]:
    """Brute force over counts. The k-th arrival (1-based), with A requests admitted before it, is admitted iff
    (share) the credit its k arrivals brought since the start, k × share − A, and for every earlier arrival j the
    credit saved at j (at most `depth`) plus what came after, depth + (k − j) × share − (A − A_j), each reach one
    request; and (second bucket: rate r, depth d, full at the first arrival) for u the first arrival and every
    admitted one before k, d + r × (t_k − u) − (requests admitted from u on) is at least one."""
    admitted: list[bool] = []
    before = [0]  # before[j]: requests admitted among the first j arrivals
    times: list[float] = []
    for k, t in enumerate(arrival_s, start=1):
        a = before[-1]
        credit = min([k * share - a] + [depth + (k - j) * share - (a - before[j]) for j in range(1, k)])
        ok = credit >= 1.0 - TOLERANCE
        if ok and peak is not None:
            rate, d = peak
            starts = [0] + [i for i in range(k - 1) if admitted[i]]
            ok = all(d + rate * (t - times[i]) - (a - before[i]) >= 1.0 for i in starts)
        admitted.append(ok)
        times.append(t)
        before.append(a + ok)
    return admitted


def _stream(rng: np.random.Generator, n: int) -> np.ndarray:
    """Arrivals at 1 req/s on average in alternating calm and bursty stretches (rates 0.2 to 5 req/s)."""
    rates = np.repeat(rng.uniform(0.2, 5.0, n // 20 + 1), 20)[:n]
    return np.cumsum(rng.exponential(1.0 / rates))


@pytest.mark.parametrize("seed", SEEDS)
def test_share_bucket_admits_what_the_counting_model_admits(seed):
    """Random streams, shares, depths and second buckets (a third of them without one): request by request the
    same decisions; without a second bucket, exactly ⌊k × share⌋ of the first k arrivals."""
    rng = np.random.default_rng(seed)
    arrival = _stream(rng, 300).tolist()
    share = float(rng.uniform(0.05, 0.95))
    depth = float(rng.choice([1.0, rng.uniform(1.0, 30.0)]))
    peak = None if seed % 3 == 0 else (float(share * rng.uniform(0.4, 1.6)), float(rng.uniform(1.0, 12.0)))
    got = Admission({"m": share}, {"m": depth}, {"m": peak} if peak else None, shares={"m": share}).admits(
        "m", arrival)
    assert got == _counting(arrival, share, depth, peak)
    if peak is None:
        assert np.cumsum(got).tolist() == [int(np.floor(k * share + TOLERANCE)) for k in range(1, len(got) + 1)]
    else:
        assert 0 < sum(got) < int(np.floor(len(got) * share + TOLERANCE))  # the second bucket binds somewhere


def test_credit_saved_while_the_second_bucket_is_empty_is_capped_at_the_depth():
    """Share 0.5, depth 3, a second bucket of 10 requests refilling at 0.5 req/s: 40 arrivals at once bring 20
    requests' credit, the second bucket passes 10 of them and the share bucket keeps 3 of the other 10; 100 s later
    (the second bucket full again) 10 arrivals at once pass those 3 plus the 5 their own credit brings, not the 10
    the uncapped credit and the second bucket would allow."""
    adm = Admission({"m": 0.5}, {"m": 3.0}, {"m": (0.5, 10.0)}, shares={"m": 0.5})
    assert sum(adm.admits("m", [0.0] * 40)) == 10
    assert sum(adm.admits("m", [100.0] * 10)) == 3 + 5


def test_retry_after_a_share_shed_is_the_time_the_plans_demand_takes_to_bring_a_request():
    """Admitting 2 req/s as half of what it sends (a plan demand of 4 req/s): the first request brings half a
    request's credit and is shed; one more request at the plan's demand, 0.25 s later, brings the rest."""
    adm = Admission({"m": 2.0}, shares={"m": 0.5})
    assert not adm.admit("m", 0.0)
    assert adm.retry_after_s("m", 0.0) == pytest.approx(1.0 / 4.0)
    assert adm.admit("m", 0.25) and adm.retry_after_s("m", 0.25) == pytest.approx(1.0 / 2.0)
