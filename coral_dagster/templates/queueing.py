"""Queueing bounds behind T̂: the M/G/1 utilisation a prefill node keeps its TTFT at, the Poisson load a decode batch
holds, the utilisation a decode node's NIC keeps its KV hand-offs within the TPOT at, the KV cache's hold on a
Poisson number of sequences of unequal contexts.

A prefill node under Poisson arrivals works its prompts' tokens first-come first-served at μ tokens/s (chunked
prefill batches whatever is queued), so a prompt's time to its first token is the M/G/1 sojourn W + P/μ. The
waiting time W solves the Pollaczek–Khinchine renewal equation w = (1 − ρ)·δ₀ + ρ·(r * w), r the equilibrium
residual density of the service time. On a grid of step h = budget / n, service times are rounded up to whole
steps (so the answer errs towards longer sojourns), the residual of the rounded service puts mass
P(m ≥ k) / E[m] on step k ≥ 1, and the equation is solved step by step (r₀ = 0, so it is explicit).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from coral_dagster.errors import CoralError

#: Grid steps over the sojourn budget.
GRID_STEPS = 400
#: Utilisation is found to this absolute precision.
UTILISATION_TOL = 1e-3


def sojourn_within(steps: np.ndarray, probs: np.ndarray, rho: float, n: int) -> float:
    """P(W + S ≤ n steps) of an M/G/1 queue at utilisation `rho` whose service takes `steps[i]` whole grid steps
    (≥ 1) with probability `probs[i]` (`rho` is the utilisation of that rounded service)."""
    if not 0 <= rho < 1:
        return 0.0
    served = np.zeros(n + 1)  # P(m = k), mass beyond n dropped (it cannot finish in time)
    inside = steps <= n
    np.add.at(served, steps[inside], probs[inside])
    mean_steps = float(np.dot(steps, probs))
    at_least = 1.0 - np.concatenate(([0.0], np.cumsum(served)[:-1]))  # P(m ≥ k), k = 0..n
    residual = at_least / mean_steps
    residual[0] = 0.0
    w = np.zeros(n + 1)
    w[0] = 1.0 - rho
    rev = residual[::-1]  # rev[n - k] = residual[k]
    for i in range(1, n + 1):
        w[i] = rho * float(np.dot(rev[n - i:n], w[:i]))
    finish_by = np.cumsum(served)  # P(m ≤ k)
    return float(np.dot(w, finish_by[::-1]))


def _rounded(prompt_tokens: np.ndarray, budget_tokens: float, n: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Service steps per distinct prompt length when `budget_tokens` is n steps, their probabilities, and the
    ratio of the rounded mean service to the true one."""
    steps = np.maximum(np.ceil(prompt_tokens * n / budget_tokens - 1e-9), 1).astype(np.int64)
    uniq, counts = np.unique(steps, return_counts=True)
    probs = counts / counts.sum()
    inflation = float(np.dot(uniq, probs)) * budget_tokens / n / float(prompt_tokens.mean())
    return uniq, probs, inflation


def max_utilisation(prompt_tokens: np.ndarray, budget_tokens: float, target: float, n: int = GRID_STEPS) -> float:
    """The highest utilisation ρ = λ·E[P]/μ at which a FIFO server of μ tokens/s, fed Poisson prompts of the given
    lengths, finishes a share `target` of them within the time it needs for `budget_tokens` tokens; 0 when even
    an empty queue misses (more than 1 − target of the prompts are longer than the budget)."""
    if not 0 < target < 1:
        raise CoralError(f"attainment target {target:g}.", "give a target in (0, 1), e.g. 0.95.")
    prompts = np.asarray(prompt_tokens, dtype=np.float64)
    if prompts.size == 0 or prompts.min() <= 0:
        raise CoralError("prompt lengths are empty or not positive.", "give at least one positive prompt length.")
    if budget_tokens <= 0:
        return 0.0
    steps, probs, inflation = _rounded(prompts, float(budget_tokens), n)
    if sojourn_within(steps, probs, 0.0, n) < target:
        return 0.0
    lo, hi = 0.0, 1.0 / inflation
    while hi - lo > UTILISATION_TOL:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if sojourn_within(steps, probs, mid * inflation, n) >= target else (lo, mid)
    return lo


#: Budgets (in tokens) are rounded down to this grid per doubling before the cached solve (errs lower).
_BUDGET_STEPS_PER_DOUBLING = 32


@lru_cache(maxsize=None)
def trace_lengths(trace: str) -> tuple[np.ndarray, np.ndarray]:
    """(prompt tokens, output tokens) of every request of a bundled trace."""
    from coral_dagster.catalog.traces import load_trace

    df = load_trace(trace)
    return df.prompt_tokens.to_numpy(dtype=np.float64), df.output_tokens.to_numpy(dtype=np.float64)


@lru_cache(maxsize=None)
def _cached(trace: str, seq_tokens: int, grid_index: int, target: float) -> float:
    prompts = trace_lengths(trace)[0] if trace else np.array([float(seq_tokens)])
    return max_utilisation(prompts, 2.0 ** (grid_index / _BUDGET_STEPS_PER_DOUBLING), target)


def prefill_utilisation(trace: str, seq_tokens: int, budget_tokens: float, target: float) -> float:
    """`max_utilisation` for the prompts of a bundled trace (or, with no trace, prompts all of `seq_tokens`),
    the budget rounded down to a fine log grid so nearby nodes share one solve."""
    if budget_tokens < 1:
        return 0.0
    index = math.floor(math.log2(budget_tokens) * _BUDGET_STEPS_PER_DOUBLING)
    return _cached(trace, int(seq_tokens), index, float(target))


def handoff_utilisation(prompt_tokens: np.ndarray, output_tokens: np.ndarray, ms_per_prompt_token: float,
                        cycle_ms: float, tpot_ms: float, target: float) -> float:
    """The highest utilisation ρ of a decode node's receiving NIC at which a share `target` of requests keep their
    mean TPOT within `tpot_ms`; 0 when more than 1 − target of them miss even at an idle NIC.

    The NIC is an M/G/1 processor-sharing server (concurrent transfers share it, `simulator.engine`) of the requests'
    KV transfers, P · `ms_per_prompt_token` ms for a prompt of P tokens; under processor sharing a transfer of x ms
    takes x / (1 − ρ) on average, whatever the sizes' distribution. A request of D output tokens then waits up to one
    cycle c to join its micro-batch and takes D − 1 cycles, so it keeps its TPOT when
    P·h / (1 − ρ) + c + (D − 1)·c ≤ (D − 1)·ℓ, i.e. ρ ≤ 1 − P·h / ((D − 1)(ℓ − c) − c); ρ* is the (1 − target)
    quantile of that bound over the requests (one-token requests have nothing to decode and always keep it).
    """
    if not 0 < target < 1:
        raise CoralError(f"attainment target {target:g}.", "give a target in (0, 1), e.g. 0.95.")
    prompts = np.asarray(prompt_tokens, dtype=np.float64)
    outputs = np.asarray(output_tokens, dtype=np.float64)
    room_ms = (outputs - 1) * (tpot_ms - cycle_ms) - cycle_ms
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = np.where(room_ms > 0, 1.0 - prompts * ms_per_prompt_token / room_ms, -np.inf)
    bound = np.where(outputs <= 1, 1.0, bound)
    k = math.floor(bound.size * (1.0 - target) + 1e-9)  # at least bound.size - k ≥ target · size keep it
    rho = float(np.partition(bound, k)[k])
    return min(max(rho, 0.0), 1.0 - 1e-9)


def decode_rate(idle_cycle_ms: float, per_seq_ms: float, slots: int, target: float) -> float:
    """The highest token rate λ (tokens/s) at which the number N of running decode sequences stays within `slots`
    with probability `target`, when a cycle (every running sequence gains one token) takes c(N) = idle_cycle_ms +
    per_seq_ms · N. Sequences arrive Poisson and leave after their output, so N is a birth-death chain with birth
    rate λ/E[D] and death rate N / (E[D] · c(N)) (a symmetric queue: insensitive to the output length
    distribution), π(N) ∝ Π_{k≤N} λ·c(k)/k; with per_seq_ms = 0 it is the M/G/∞ Poisson count."""
    if slots < 1 or idle_cycle_ms <= 0 or per_seq_ms < 0:
        return 0.0
    k = np.arange(1, 4 * slots + 101, dtype=np.float64)
    log_terms = np.log((idle_cycle_ms + per_seq_ms * k) / 1000.0 / k)

    def within(rate: float) -> float:
        log_pi = np.concatenate(([0.0], np.cumsum(log_terms + math.log(rate))))
        pi = np.exp(log_pi - log_pi.max())
        return float(pi[:slots + 1].sum() / pi.sum())

    cap = slots * 1000.0 / (idle_cycle_ms + per_seq_ms * slots)  # every slot busy all the time
    lo, hi = 0.0, cap
    if within(cap * 1e-9) < target:
        return 0.0
    while hi - lo > 1e-4 * cap:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if within(mid) >= target else (lo, mid)
    return lo


#: Grid steps over a KV cache in `kv_sequences`.
KV_GRID_STEPS = 256


def kv_sequences(context_tokens: np.ndarray, weights: np.ndarray, capacity_tokens: float, target: float) -> float:
    """The highest mean n of a Poisson number of resident sequences whose contexts (`context_tokens` with
    probabilities ∝ `weights`) sum to at most `capacity_tokens` with probability `target`: the total is compound
    Poisson, its distribution by Panjer's recursion f(x) = (n / x) Σ_k k·g(k)·f(x − k) on a grid of
    capacity / `KV_GRID_STEPS` tokens, contexts rounded up to whole steps (errs towards fuller caches)."""
    if not 0 < target < 1:
        raise CoralError(f"attainment target {target:g}.", "give a target in (0, 1), e.g. 0.95.")
    if capacity_tokens <= 0:
        return 0.0
    n_grid = KV_GRID_STEPS
    steps = np.maximum(np.ceil(np.asarray(context_tokens, dtype=np.float64) * n_grid / capacity_tokens - 1e-9), 1)
    g = np.zeros(n_grid + 1)
    inside = steps <= n_grid
    np.add.at(g, steps[inside].astype(np.int64), np.asarray(weights, dtype=np.float64)[inside])
    g /= float(np.sum(weights))  # mass beyond the cache stays out: one such sequence already overflows it
    kg = np.arange(n_grid + 1) * g

    def within(n: float) -> float:
        f = np.zeros(n_grid + 1)
        f[0] = math.exp(-n)
        for x in range(1, n_grid + 1):
            f[x] = n / x * float(np.dot(kg[1:x + 1], f[x - 1::-1]))
        return float(f.sum())

    hi = float(n_grid)  # every sequence takes at least one step
    if within(1e-9) < target:
        return 0.0
    lo = 0.0
    while hi - lo > 1e-3 * max(lo, 1.0):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if within(mid) >= target else (lo, mid)
    return lo


#: Points per request at which a resident sequence's context is sampled (its age uniform over its output).
_AGE_POINTS = 8


@lru_cache(maxsize=None)
def _resident_contexts(trace: str) -> tuple[np.ndarray, np.ndarray]:
    """Contexts of a resident sequence of a bundled trace and their weights: a request is resident for a time
    ∝ its output D (length-biased), at an age uniform over it, so its context is P + u·D."""
    prompts, outputs = trace_lengths(trace)
    ages = (np.arange(_AGE_POINTS) + 0.5) / _AGE_POINTS
    contexts = (prompts[:, None] + outputs[:, None] * ages[None, :]).ravel()
    return contexts, np.repeat(outputs, _AGE_POINTS)


@lru_cache(maxsize=None)
def _kv_cached(trace: str, grid_index: int, target: float) -> float:
    contexts, weights = _resident_contexts(trace)
    return kv_sequences(contexts, weights, 2.0 ** (grid_index / _BUDGET_STEPS_PER_DOUBLING), target)


def trace_kv_sequences(trace: str, capacity_tokens: float, target: float) -> float:
    """`kv_sequences` for the resident sequences of a bundled trace, the capacity rounded down to a fine log grid
    so nearby nodes share one solve."""
    if capacity_tokens < 1:
        return 0.0
    return _kv_cached(trace, math.floor(math.log2(capacity_tokens) * _BUDGET_STEPS_PER_DOUBLING), float(target))
