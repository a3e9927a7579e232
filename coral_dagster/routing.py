"""The one routing policy of a plan, shared by the simulator and the runtime coordinator.

Weights are in units of a model's demand: an instance's weight is the fraction of the model's requests it can take
in its phase (prefill tokens/s over prefill demand, decode or aggregated output tokens/s over decode demand). A request
enters one of its model's prefill or aggregated instances by smooth weighted round-robin; a prefill instance's weight
is scaled by min(1, decode / prefill weight of its region), so each region receives the share of the model's requests
both phases can take there (the `routing_shares` a plan records), and the request decodes in the region it was
prefilled in, by smooth weighted round-robin over that region's decode instances. Every choice is made when the
request arrives, so the same plan and request stream give the same per-instance counts wherever the policy runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping, Sequence

from coral_dagster.vocab import DEMAND_PHASES

ENTRY_PHASES = ("prefill", "aggregated")
# Share credit is a sum of floats: an arrival that brings it within this of a whole request takes it.
CREDIT_TOLERANCE = 1e-9


class WeightedRoundRobin:
    """Each pick adds every weight to its key's credit, takes the key with most credit and charges it the total.

    Over any window of `sum(weights)` picks with integer weights each key is chosen exactly `weight` times. Keys may
    come and go between picks (instances joining, draining); a key's credit is forgotten when it leaves.
    """

    def __init__(self) -> None:
        self._credit: dict[Hashable, float] = {}

    def pick(self, weights: Mapping[Hashable, float]) -> Hashable:
        live = {k: w for k, w in weights.items() if w > 0}
        if not live:
            raise ValueError("no key with positive weight to pick from")
        self._credit = {k: self._credit.get(k, 0.0) + w for k, w in live.items()}
        best = max(sorted(live, key=str), key=lambda k: self._credit[k])
        self._credit[best] -= sum(live.values())
        return best


@dataclass(frozen=True)
class Candidate:
    """An instance the router may pick: its key, model, phase, region and weight (fraction of demand it takes)."""

    key: Hashable
    model: str
    phase: str
    region: str
    weight: float


def entry_weights(candidates: Iterable[Candidate]) -> dict[Hashable, float]:
    """Entry weight per prefill or aggregated candidate: a prefill one scaled by its region's decode/prefill ratio
    (capped at 1), so a region takes no more of a model's requests than its decode can finish. A model with no
    decode or aggregated candidate anywhere is prefill-only (a template measured alone): its prefill weights stay,
    and its requests end after their first token."""
    cands = list(candidates)
    pre: dict[str, float] = {}
    dec: dict[str, float] = {}
    for c in cands:
        if c.phase == "prefill":
            pre[c.region] = pre.get(c.region, 0.0) + c.weight
        elif c.phase == "decode":
            dec[c.region] = dec.get(c.region, 0.0) + c.weight
    finishes = bool(dec) or any(c.phase == "aggregated" for c in cands)
    out: dict[Hashable, float] = {}
    for c in cands:
        if c.phase == "aggregated":
            out[c.key] = c.weight
        elif c.phase == "prefill" and pre[c.region] > 0:
            out[c.key] = c.weight * (min(1.0, dec.get(c.region, 0.0) / pre[c.region]) if finishes else 1.0)
    return out


def region_shares(candidates: Iterable[Candidate]) -> dict[str, float]:
    """The share of a model's requests each region receives under `entry_weights` (sums to 1, or empty)."""
    cands = list(candidates)
    by_key = {c.key: c for c in cands}
    totals: dict[str, float] = {}
    for key, w in entry_weights(cands).items():
        totals[by_key[key].region] = totals.get(by_key[key].region, 0.0) + w
    total = sum(totals.values())
    return {r: w / total for r, w in sorted(totals.items())} if total > 0 else {}


class Router:
    """Picks (entry, decode) candidates for each request of a model from the live candidates at that moment."""

    def __init__(self) -> None:
        self._entry: dict[str, WeightedRoundRobin] = {}
        self._decode: dict[tuple[str, str], WeightedRoundRobin] = {}

    def can_route(self, model: str, candidates: Sequence[Candidate]) -> bool:
        """Whether `route` would find a route (without taking a turn)."""
        return any(w > 0 for w in entry_weights(c for c in candidates if c.model == model).values())

    def route(self, model: str, candidates: Sequence[Candidate]) -> tuple[Candidate, Candidate | None] | None:
        """The entry instance and, for a prefill entry, the decode instance in its region (None for a prefill-only
        model); None when the model has no live route (no entry instance, or prefill only where no decode is
        live while some other region has one)."""
        mine = [c for c in candidates if c.model == model]
        weights = entry_weights(mine)
        if not any(w > 0 for w in weights.values()):
            return None
        by_key = {c.key: c for c in mine}
        entry = by_key[self._entry.setdefault(model, WeightedRoundRobin()).pick(weights)]
        if entry.phase == "aggregated":
            return entry, None
        local = {c.key: c.weight for c in mine if c.phase == "decode" and c.region == entry.region}
        if not local:
            return entry, None
        decode = by_key[self._decode.setdefault((model, entry.region), WeightedRoundRobin()).pick(local)]
        return entry, decode


def instance_weight(phase: str, tokens_per_s: float, demand_tokens_per_s: Mapping[tuple[str, str], float],
                    model: str) -> float:
    """The fraction of the model's demand one instance takes: prefill tokens/s over prefill demand, decode or
    aggregated (output) tokens/s over decode demand; its tokens/s where the model has no such demand."""
    demand = demand_tokens_per_s.get((model, "prefill" if phase == "prefill" else "decode"), 0.0)
    return tokens_per_s / demand if demand > 0 else tokens_per_s


def plan_candidates(plan) -> list[Candidate]:
    """Every instance copy of a plan (`.instances`, `.demand_tokens_per_s`) as a candidate keyed
    (template_id, region, copy)."""
    out = []
    for pi in sorted(plan.instances, key=lambda p: (p.template.template_id, p.region)):
        t = pi.template
        w = instance_weight(t.phase, t.tokens_per_s, plan.demand_tokens_per_s, t.model)
        out += [Candidate((t.template_id, pi.region, k), t.model, t.phase, pi.region, w) for k in range(pi.count)]
    return out


def plan_shares(plan) -> dict[str, dict[str, float]]:
    """Per model, the share of its requests each region receives under this policy."""
    cands = plan_candidates(plan)
    return {m: region_shares([c for c in cands if c.model == m]) for m in sorted({c.model for c in cands})}


class Admission:
    """Admission control under scarcity, per model two token buckets; a request is admitted when each holds a
    token, and takes one from each. The first keeps the plan's share: where `shares` gives one, every request the
    model sends credits it with that share (the plan's served fraction), so the model is admitted that share of
    what it sends, whether it sends more or less than the plan's demand; credit the second bucket keeps it from
    using is saved up to `depths_req` requests (the burst of the model's trace the plan was sized for; `burst_s`
    seconds of its rate where none is given) and spent as the second allows. Without a share, the first refills at
    the request rate the plan serves (`rates_req_s`) and holds `depths_req`. The second, where `peaks` gives one
    (rate, depth), refills at most at the request rate the plan's capacity carries, so what the first lets in
    arrives no faster than the plan can serve it within its SLO (`capacity.peak_bucket`). A share bucket starts
    empty and the second full; a rate bucket starts holding no more than the second (started full, a deep one lets
    a model past its rate for as long as its depth lasts). A request that finds a bucket empty is shed at once (the
    front door answers 429 with Retry-After), so the admitted ones keep their SLO. A model at rate or share 0 (the
    plan serves none of it) is always shed; models without a rate are always admitted."""

    def __init__(self, rates_req_s: Mapping[str, float], depths_req: Mapping[str, float] | None = None,
                 peaks: Mapping[str, Sequence[float]] | None = None, burst_s: float = 10.0,
                 shares: Mapping[str, float] | None = None) -> None:
        self.rates = {m: float(r) for m, r in rates_req_s.items() if r >= 0}
        self.shares = {m: float(s) for m, s in (shares or {}).items() if m in self.rates}
        self.depths = {m: max(1.0, float((depths_req or {}).get(m, r * burst_s))) if r > 0 else 0.0
                       for m, r in self.rates.items()}
        peaks = peaks or {}
        self._buckets = {m: [(r, self.depths[m])] + ([(float(peaks[m][0]), max(1.0, float(peaks[m][1])))]
                                                      if m in peaks else []) for m, r in self.rates.items()}
        self._tokens = {m: [0.0 if m in self.shares else min(d for _, d in b)] + [d for _, d in b[1:]]
                        for m, b in self._buckets.items()}
        self._last: dict[str, float] = {}

    def _refill(self, model: str, now_s: float) -> list[float]:
        last = self._last.get(model, now_s)
        elapsed = max(0.0, now_s - last)
        by_arrival = model in self.shares
        self._tokens[model] = [t if k == 0 and by_arrival else min(d, t + elapsed * r)
                               for k, ((r, d), t) in enumerate(zip(self._buckets[model], self._tokens[model]))]
        self._last[model] = max(last, now_s)
        return self._tokens[model]

    def admit(self, model: str, now_s: float) -> bool:
        """Credit the model's share bucket with its share (if it has one), then take one request's token from each
        of its buckets if every one has one; share credit beyond the depth is dropped."""
        if model not in self.rates:
            return True
        tokens = self._refill(model, now_s)
        share = self.shares.get(model)
        if share is not None:
            tokens[0] += share
        need = 1.0 - (CREDIT_TOLERANCE if share is not None else 0.0)
        admitted = tokens[0] >= need and all(t >= 1.0 for t in tokens[1:])
        if admitted:
            tokens[:] = [t - 1.0 for t in tokens]
        if share is not None:
            tokens[0] = min(tokens[0], self.depths[model])
        return admitted

    def admits(self, model: str, arrivals_s: Iterable[float]) -> list[bool]:
        """Which of the model's requests arriving at `arrivals_s` (in order) are admitted, one `admit` each."""
        return [self.admit(model, t) for t in arrivals_s]

    def limits(self, model: str) -> str:
        """The model's admission limits in words, for the message of a shed request."""
        (rate, depth), *peak = self._buckets[model]
        if model in self.shares:
            text = (f"{self.shares[model]:.1%} of the requests it sends ({rate:.3g} req/s at the plan's demand), "
                    f"saving up to {depth:.0f} requests' credit")
        else:
            text = f"{rate:.3g} req/s with bursts of up to {depth:.0f} requests"
        return text + "".join(f", at most {r:.3g} req/s over {d:.0f} requests" for r, d in peak)

    def retry_after_s(self, model: str, now_s: float) -> float:
        """Seconds until every one of the model's buckets holds a token again (a share bucket's credit counted at
        the rate its share of the plan's demand brings)."""
        if model not in self.rates:
            return 0.0
        waits = [max(0.0, 1.0 - t) / r if r > 0 else (60.0 if t < 1.0 else 0.0)
                 for (r, _), t in zip(self._buckets[model], self._refill(model, now_s))]
        return max(waits)


def admission_shares(plan) -> dict[str, float]:
    """Per model a plan (`.admission`, `.served_fraction()`) admits less of than its demand, the share it promises:
    the least served fraction over the demand's phases."""
    served = plan.served_fraction()
    return {m: min([served.get((m, p), 1.0) for p in DEMAND_PHASES]) for m in sorted(plan.admission.admit_req_s)}


def plan_admission(plan) -> Admission | None:
    """The admission a plan's limits configure, each limited model held to its promised share of what it sends
    (`admission_shares`); None where the plan limits no model."""
    adm = plan.admission
    if not adm.limits:
        return None
    return Admission(adm.admit_req_s, adm.admit_depth_req, adm.admit_peak, shares=admission_shares(plan))
