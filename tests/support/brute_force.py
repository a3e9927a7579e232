"""Brute-force oracles the allocation tests share: every integer plan of a small instance, and what it serves."""

from __future__ import annotations

from coral_dagster.allocation.problem import AllocationProblem


def routed(problem: AllocationProblem, counts) -> dict[str, float]:
    """Per model with demand, the share of its requests served with both phases in one region (capped at 1),
    from {(template, region): count}: Σ_r min over phases of served in r / demand."""
    served: dict[tuple, float] = {}
    for (t, r), n in counts.items():
        gives = ({"prefill": t.tokens_per_s * problem.prompt_per_output.get(t.model, 0.0),
                  "decode": t.tokens_per_s} if t.phase == "aggregated" else {t.phase: t.tokens_per_s})
        for phase, tok in gives.items():
            served[(t.model, phase, r)] = served.get((t.model, phase, r), 0.0) + n * tok
    regions = sorted({r for r, _ in problem.usd_per_hour})
    out = {}
    for model in sorted({m for (m, _), d in problem.demand_tokens_per_s.items() if d > 0}):
        phases = [(m, p) for (m, p), d in problem.demand_tokens_per_s.items() if m == model and d > 0]
        out[model] = min(1.0, sum(min(1.0, *(served.get(k + (r,), 0.0) / problem.demand_tokens_per_s[k]
                                             for k in phases)) for r in regions))
    return out


def every_plan(problem: AllocationProblem, pairs, pool):
    """Every integer count vector over (template, region) `pairs` within the nodes of `pool`, with its cost."""
    def walk(i, free, chosen):
        if i == len(pairs):
            yield dict(chosen), sum(n * problem.instance_usd_per_hour(t, r) for (t, r), n in chosen.items())
            return
        t, r = pairs[i]
        n = 0
        while all(free.get((r, c), 0) >= k * n for c, k in t.nodes.counts):
            nxt = dict(free)
            for c, k in t.nodes.counts:
                nxt[(r, c)] = free.get((r, c), 0) - k * n
            yield from walk(i + 1, nxt, {**chosen, (t, r): n} if n else chosen)
            n += 1
    yield from walk(0, dict(pool), {})
