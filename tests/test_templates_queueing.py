"""The queueing bounds behind T̂ against closed forms (M/M/1, M/D/1, Poisson), a direct event simulation of the
decode birth-death chain and of a processor-sharing NIC, and Monte Carlo of a compound Poisson KV load; prefill and
decode templates alone in the simulator at 95% of T̂ over several seeds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from coral_dagster.catalog.scenarios import load_scenario
from coral_dagster.errors import CoralError
from coral_dagster.simulator.latency import ProfileLatencyModel
from coral_dagster.simulator.reach import template_reach
from coral_dagster.templates.best import best_for_nodes, one_path_only
from coral_dagster.templates.queueing import (
    _rounded,
    decode_rate,
    handoff_utilisation,
    kv_sequences,
    max_utilisation,
    sojourn_within,
    trace_lengths,
)

N = 400


def exponential_quantiles(n: int = 20000) -> np.ndarray:
    """Service times of mean 1 at evenly spaced quantiles of Exp(1): deterministic, no seed."""
    return -np.log(1.0 - (np.arange(n) + 0.5) / n)


def md1_wait_cdf(t: float, rho: float) -> float:
    """Erlang's M/D/1 waiting-time distribution, unit service: (1-ρ) Σ_{k≤t} (ρ(k-t))^k / k! e^{-ρ(k-t)}."""
    return (1 - rho) * sum((rho * (k - t)) ** k / math.factorial(k) * math.exp(-rho * (k - t))
                           for k in range(int(math.floor(t)) + 1))


@pytest.mark.parametrize("rho", [0.3, 0.6, 0.8])
def test_sojourn_matches_mm1_and_errs_long(rho):
    """M/M/1 sojourn is Exp(μ − λ): P(T ≤ b) = 1 − e^{−(1−ρ)b} for unit mean service."""
    budget = 5.0
    steps, probs, inflation = _rounded(exponential_quantiles(), budget, N)
    got = sojourn_within(steps, probs, rho * inflation, N)
    exact = 1 - math.exp(-(1 - rho) * budget)
    assert got <= exact + 1e-3
    assert got == pytest.approx(exact, abs=0.015)


@pytest.mark.parametrize("rho, budget", [(0.5, 4.0), (0.8, 4.0), (0.9, 12.0)])
def test_sojourn_matches_md1_closed_form(rho, budget):
    """Exact for the service rounded up to the grid (1 + δ), and so never above the queue it stands for."""
    steps, probs, inflation = _rounded(np.array([1.0]), budget, N)
    got = sojourn_within(steps, probs, rho * inflation, N)
    d = inflation  # the rounded service time, in units of the true one
    rounded = md1_wait_cdf((budget - d) / d, rho * d)  # sojourn = wait + one service, in units of d
    assert got == pytest.approx(rounded, abs=0.01)
    assert got <= md1_wait_cdf(budget - 1.0, rho) + 1e-3


@pytest.mark.parametrize("budget, target", [(5.0, 0.95), (20.0, 0.95), (10.0, 0.9)])
def test_max_utilisation_matches_mm1_closed_form(budget, target):
    """Exp(μ − λ) within b with probability q  ⇔  ρ ≤ 1 + ln(1 − q) / (μ b). Rounding every service up by under
    one grid step (budget / N, in mean services) raises the load by at most that share, so ρ* falls by at most it."""
    exact = 1 + math.log(1 - target) / budget
    got = max_utilisation(exponential_quantiles() * 1000, budget * 1000, target)
    assert exact * (1 - budget / N) - 1e-3 <= got <= exact + 1e-3


def test_max_utilisation_is_zero_when_long_prompts_overrun_an_empty_queue():
    prompts = np.r_[np.full(90, 100.0), np.full(10, 2000.0)]  # 10% need 2,000 tokens of work
    assert max_utilisation(prompts, 1500, 0.95) == 0.0
    assert max_utilisation(prompts, 1500, 0.85) > 0.0
    with pytest.raises(CoralError, match="target"):
        max_utilisation(prompts, 1500, 1.0)


@pytest.mark.parametrize("slots", [4, 30, 200])
def test_decode_rate_with_a_fixed_cycle_is_the_poisson_quantile(slots):
    """A fixed cycle c makes N Poisson(λ c): the rate is the largest mean whose Poisson CDF at `slots` is 0.95."""
    cycle_ms = 40.0
    rate = decode_rate(cycle_ms, 0.0, slots, 0.95)
    mean = rate * cycle_ms / 1000.0
    cdf = lambda m: sum(math.exp(k * math.log(m) - m - math.lgamma(k + 1)) for k in range(slots + 1))  # noqa: E731
    assert cdf(mean) >= 0.95 - 1e-6
    assert cdf(mean * 1.01) < 0.95


def _birth_death_share(rate: float, idle_ms: float, per_seq_ms: float, slots: int, seed: int,
                       horizon_s: float = 4000.0) -> float:
    """Time share with N ≤ slots in a direct event simulation: Poisson arrivals at rate/E[D], each sequence needs
    a geometric number of cycle steps (mean E[D]); one cycle of c(N) ms advances every sequence by one token."""
    rng = np.random.default_rng(seed)
    mean_out = 50.0
    lam = rate / mean_out
    t, n, within, next_arrival = 0.0, 0, 0.0, rng.exponential(1 / lam)
    while t < horizon_s:
        cycle = (idle_ms + per_seq_ms * n) / 1000.0
        if n == 0:
            t = next_arrival
            n = 1
            next_arrival = t + rng.exponential(1 / lam)
            continue
        end = t + cycle
        while next_arrival < end:  # arrivals during a cycle join after it
            n += 1
            next_arrival += rng.exponential(1 / lam)
        within += cycle if n <= slots else 0.0
        n -= rng.binomial(n, 1 / mean_out)  # each running sequence finishes with probability 1/E[D]
        t = end
    return within / t


def test_decode_rate_against_an_event_simulation_of_the_chain():
    """At the rate the bound gives, the simulated chain keeps N within the slots ≥ 95% of the time (pooled over
    seeds, less three standard errors of the seeds' spread); at 1.25× that rate it does not."""
    idle_ms, per_seq_ms, slots = 30.0, 0.4, 60
    rate = decode_rate(idle_ms, per_seq_ms, slots, 0.95)
    at = [_birth_death_share(rate, idle_ms, per_seq_ms, slots, seed) for seed in range(4)]
    over = [_birth_death_share(1.25 * rate, idle_ms, per_seq_ms, slots, seed) for seed in range(4)]
    assert np.mean(at) + 3 * np.std(at, ddof=1) / 2 >= 0.95
    assert np.mean(over) + 3 * np.std(over, ddof=1) / 2 < 0.95


def processor_sharing_sojourn(arrival_ms: np.ndarray, work_ms: np.ndarray) -> np.ndarray:
    """Sojourn times of an egalitarian processor-sharing server (n jobs in: each served at 1/n), by virtual time."""
    import heapq

    finish = np.empty(len(arrival_ms))
    heap: list = []
    t = v = 0.0

    def complete_until(limit: float) -> None:
        nonlocal t, v
        while heap and t + (heap[0][0] - v) * len(heap) <= limit:
            f, i = heapq.heappop(heap)
            t += (f - v) * (len(heap) + 1)
            v = f
            finish[i] = t

    for i, (a, x) in enumerate(zip(arrival_ms, work_ms)):
        complete_until(a)
        if heap:
            v += (a - t) / len(heap)
        t = a
        heapq.heappush(heap, (v + x, i))
    complete_until(math.inf)
    return finish - arrival_ms


def test_handoff_utilisation_against_a_processor_sharing_nic():
    """Poisson KV transfers of the helix trace's requests (16 layers of Llama-2-70B over 10 Gb/s) into one
    processor-sharing NIC: at ρ* at least 95% of requests keep P·h-plus-cycles within their TPOT budget (pooled over
    three seeds, 3σ), and at a load halfway from ρ* to 1 they do not."""
    prompts, outputs = trace_lengths("azure-conv")
    h_ms, cycle_ms, tpot_ms, target = 16 * 4096 * 8 / 10e9 * 1e3, 60.0, 80.0, 0.95
    rho = handoff_utilisation(prompts, outputs, h_ms, cycle_ms, tpot_ms, target)
    assert 0.1 < rho < 0.9
    mean_ms = prompts.mean() * h_ms

    def share(load: float) -> float:
        met = total = 0
        for seed in (1, 2, 3):
            rng = np.random.default_rng(seed)
            n = 20000
            pick = rng.integers(0, len(prompts), n)
            arrival = np.cumsum(rng.exponential(mean_ms / load, n))
            sojourn = processor_sharing_sojourn(arrival, prompts[pick] * h_ms)
            room = (outputs[pick] - 1) * (tpot_ms - cycle_ms) - cycle_ms
            met += int(np.sum(sojourn <= room))
            total += n
        return met / total

    sigma = math.sqrt(target * (1 - target) / 60000)
    assert share(rho) >= target - 3 * sigma
    assert share(rho + (1 - rho) / 2) < target


def test_handoff_utilisation_is_zero_when_short_requests_miss_at_an_idle_nic():
    """Room (D − 1)(ℓ − c) − c is negative for every request shorter than 1 + c/(ℓ − c) tokens: over 5% of them."""
    prompts, outputs = np.full(100, 1000.0), np.where(np.arange(100) < 6, 3.0, 500.0)
    assert handoff_utilisation(prompts, outputs, 0.01, 50.0, 80.0, 0.95) == 0.0
    assert handoff_utilisation(prompts, outputs, 0.01, 50.0, 80.0, 0.9) > 0.9


def test_kv_sequences_with_equal_contexts_is_the_poisson_quantile():
    """All contexts 1,000 tokens, a 25,600-token cache: 25 fit, so n* is the mean whose Poisson CDF at 25 is 0.95."""
    n_star = kv_sequences(np.full(10, 1000.0), np.ones(10), 25600.0, 0.95)

    def cdf(n: float) -> float:
        return sum(math.exp(-n) * n ** k / math.factorial(k) for k in range(26))

    lo, hi = 0.0, 25.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) >= 0.95 else (lo, mid)
    assert n_star == pytest.approx(lo, rel=2e-3)


def test_kv_sequences_against_monte_carlo_of_the_compound_poisson_load():
    """Heavy-tailed contexts (exponential, mean 1,000): at n* the sum of a Poisson number of them stays within the
    cache with probability ≥ 0.95 (the grid errs full), and at 1.25 n* it does not."""
    contexts = 1000.0 * exponential_quantiles(4000)
    cap, target = 20000.0, 0.95
    n_star = kv_sequences(contexts, np.ones_like(contexts), cap, target)
    rng = np.random.default_rng(11)

    def within(n: float) -> float:
        counts = rng.poisson(n, 40000)
        totals = np.array([contexts[rng.integers(0, len(contexts), k)].sum() for k in counts])
        return float(np.mean(totals <= cap))

    sigma = math.sqrt(target * (1 - target) / 40000)
    assert within(n_star) >= target - 3 * sigma
    assert within(n_star) <= target + 0.02
    assert within(1.25 * n_star) < target


def test_multi_stage_decode_puts_one_node_on_every_stage():
    assert one_path_only("decode", 2, 3) and one_path_only("aggregated", 3, 5)
    assert not one_path_only("decode", 3, 3) and not one_path_only("decode", 1, 4)
    assert not one_path_only("prefill", 2, 3)
    t, _, _ = best_for_nodes("qwen3-32b", "decode", "3xA10G:2,2xA10G:4", scenario="core")
    assert len(t.stages) in (1, 5) and (len(t.stages) == 1 or all(len(s.nodes) == 1 for s in t.stages))


@pytest.fixture(scope="module")
def latency():
    return ProfileLatencyModel()


@pytest.mark.parametrize("scenario, model, phase, nodes", [
    ("core", "phi-4", "prefill", "1xL40S:1"),
    ("core", "qwen3-32b", "prefill", "4xL40S:1"),  # four stages, one node each
    ("core", "qwen3-32b", "prefill", "2xA10G:2,1xL40S:1,1xL40S:2"),  # mixed GPU types over stages
    ("helix", "llama-2-70b", "prefill", "1xA100:4"),
    ("helix", "llama-2-70b", "decode", "1xA100:4"),  # KV-bound decode: a Poisson count of running sequences
    ("helix", "llama-2-70b", "decode", "5xV100:4"),  # KV hand-offs load the 10 Gb/s NICs
])
def test_templates_reach_95_percent_at_95_percent_of_t_hat(latency, scenario, model, phase, nodes):
    """Pooled over three seeds, ≥ 95% of requests meet the SLO at 95% of T̂ (Poisson arrivals, trace lengths)."""
    scn = load_scenario(scenario)
    t, _, _ = best_for_nodes(model, phase, nodes, scenario=scenario)
    met = total = 0
    for seed in (1, 2, 3):
        r = template_reach(t, scn, seed=seed, min_requests=800, latency=latency)
        met += r.attainment * r.requests
        total += r.requests
    assert met / total >= 0.95, (t.template_id, met / total)


@pytest.mark.parametrize("mu, p", [(0.05, 1.0), (0.4, 0.7), (2.5, 0.2), (9.0, 0.05), (30.0, 0.5)])
def test_polya_aeppli_cdf_is_the_closed_form_sum_and_what_a_draw_counts(mu, p):
    """Busy steps a short request sees (`_tpot_miss_share`): P(N ≤ k) for N a Poisson(μ) sum of geometric counts,
    against the closed form e^-μ Σ_j μ^j/j! C(n−1, j−1) p^j (1−p)^(n−j) and a Monte Carlo draw (the translated
    gamma above the exact range within 1% of it)."""
    from coral_dagster.templates.throughput import POLYA_AEPPLI_EXACT, polya_aeppli_cdf

    def pmf(n: int) -> float:
        if n == 0:
            return math.exp(-mu)
        return math.exp(-mu) * sum(mu ** j / math.factorial(j) * math.comb(n - 1, j - 1) * p ** j * (1 - p) ** (n - j)
                                   for j in range(1, n + 1))

    ks = np.arange(0, POLYA_AEPPLI_EXACT + 1)
    closed = np.cumsum([pmf(int(n)) for n in ks])
    np.testing.assert_allclose(polya_aeppli_cdf(ks, np.full(len(ks), mu), p), closed, rtol=1e-9, atol=1e-12)
    rng = np.random.default_rng(11)
    periods = rng.poisson(mu, 200_000)
    draws = np.array([rng.geometric(p, k).sum() if k else 0 for k in periods])
    for k in (0, 1, 3, 10, 80, 200):
        assert abs(float(polya_aeppli_cdf(np.array([k]), np.array([mu]), p)[0]) - (draws <= k).mean()) < 0.01
    assert polya_aeppli_cdf(np.array([-1]), np.array([mu]), p)[0] == 0.0
