"""Discrete-event simulation of a plan's instances serving a request stream.

Events are `(time_s, priority, seq, handler, arg)` in one heap; a handler returns its successor events as
`(time_s, priority, handler, arg)` and the loop numbers them, so equal times resolve by priority, then by the
order they were made. Work is simulated per node iteration, never per token: a decode micro-batch (`_Group`)
carries its sequences' finishing iterations in a heap, so an iteration costs O(groups), not O(sequences).

Pipelines follow vLLM's pipeline parallelism: each path (one node per stage) keeps up to S micro-batches in
flight (S = stages), a node runs at most one micro-batch of a path per iteration (micro-batches of different
paths batch together), and a new sequence joins the smallest micro-batch of its path when it next passes the
first stage.

Chunked prefill follows vLLM's: a prompt longer than a node's token budget is prefilled in chunks over several
iterations, and a later chunk attends to the KV cache of the prompt's earlier ones (`past_tokens` of the latency
model), so the chunks of a prompt cost the whole prompt's attention plus the rest of the layer once per pass. An
iteration first takes its running decode sequences, then fills the rest of the token budget (decode tokens count
in it, vLLM's `max_num_batched_tokens`) with prompt chunks, oldest first, and runs them as one forward pass
(`profiles.stage_times.fused_step_ms`: the weights are read once), as vLLM's V1 scheduler does.

KV cache follows vLLM's paged allocation: every worker of a pipeline gets the KV capacity of the smallest (vLLM
unifies KV blocks per worker to the minimum over its workers; `_limit_context`); a sequence holds its current
context on every node of its path, one more token per iteration; admission needs room for the prompt below a small
watermark; when growth overflows a node, the most recently admitted sequence of that micro-batch is preempted,
returns to the front of its instance's queue and recomputes its prompt and generated tokens when readmitted. A
request longer than its instance's `max_model_len` (prompt and output on a decode or aggregated instance, prompt
and one token on a prefill one) is refused on arrival, as vLLM's server refuses it, and counted as
`exceeds-max-model-len`.

Network follows TCP over a node's link: a node sends (and receives) at the tighter of its NIC and the scenario's
`link_gbps`, and the transfers in flight on one side share it equally (processor sharing, roughly what concurrent
TCP flows get); a transfer runs at the smaller of its two ends' shares, and a transfer between regions is also
capped at `cross_region_gbps` and delayed by the one-way latency. vLLM's KV connectors send the KV cache on
connections of their own, so a pipeline's small activations and token ids share the NIC with a KV transfer
instead of queueing behind it (a first version sent one transfer per NIC at a time, which held 8-byte token ids
behind 70 MB KV transfers, and capped every transfer at `link_gbps` on its own rather than the node's link). The
pipeline's messages from one node to another are one connection, so they land in order: each waits for the one
before it on that connection.

Routing is `coral_dagster.routing`, the policy the runtime coordinator runs: at arrival a request gets its entry
instance and, for a prefill entry, the decode instance in the same region.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from coral_dagster.allocation.types import Plan
from coral_dagster.catalog.gpus import node_spec
from coral_dagster.catalog.models import get_model
from coral_dagster.errors import CoralError
from coral_dagster.routing import Candidate, Router, instance_weight, plan_admission
from coral_dagster.profiles.stage_times import fused_step_ms
from coral_dagster.simulator.latency import LatencyModel
from coral_dagster.simulator.workload import Workload

# Completions first (they free KV and nodes), then transfers landing, then new requests, then idle nodes waking.
PRIO_DONE, PRIO_TRANSFER, PRIO_ARRIVAL, PRIO_START = 0, 1, 2, 3

# Bytes of one sampled token id sent from the last stage back to the first.
_TOKEN_ID_BYTES = 8

# How each request ended; index into FAILURES.
OK, NO_INSTANCE, TOO_LONG, NO_DECODE, UNFINISHED, SHED = 0, 1, 2, 3, 4, 5
FAILURES = ("completed", "no-instance", "exceeds-max-model-len", "no-decode-instance", "unfinished", "shed")


@dataclass(frozen=True)
class SimConfig:
    """Engine settings; the defaults follow vLLM's (chunked prefill budget, max running sequences)."""

    prefill_chunk_tokens: int | None = None
    """Tokens one iteration may prefill on a node (vLLM `max_num_batched_tokens`; decode tokens count too).
    None: per node, the batch its template planned (`Stage.batches`), else the smallest batch reaching
    `prefill_efficiency` of the best tokens/s any batch within the stage's share of the template's SLO reaches (the
    T̂ batch): near T̂'s throughput at a fraction of its latency."""
    prefill_efficiency: float = 0.95
    """With automatic chunks: the share of the best prefill throughput the chosen batch must reach."""
    max_batch_seqs: int = 256
    """Sequences one iteration may hold; running sequences per node are capped at this times the stages."""
    drain_s: float = 600.0
    """How long after the last arrival the simulation may run before unfinished requests count as failed."""
    cross_region_gbps: float = 10.0
    """Bandwidth of a transfer between regions (only when a prefill and its decode instance differ in region)."""
    cross_region_latency_ms: float = 30.0
    """One-way latency added to a transfer between regions."""
    kv_watermark: float = 0.01
    """Share of each node's KV cache admission leaves free for running sequences to grow into (vLLM's)."""
    max_model_len: int | None = None
    """Longest request (prompt + output tokens) an instance takes (vLLM `max_model_len`); it must fit the
    instance's KV cache below the watermark, as vLLM refuses to start otherwise. None: all of that cache."""


# Bounds of the automatic prefill token budget, and the prompt length it is sized at (the profiles' default).
_MIN_CHUNK_TOKENS, _MAX_CHUNK_TOKENS, _CHUNK_SEQ_TOKENS = 256, 1 << 18, 1024


def chunk_tokens_within(lat, budget_ms: float, efficiency: float) -> int:
    """The smallest prefill batch of `lat` reaching `efficiency` of the best tokens/ms among the batches one
    iteration finishes within `budget_ms`, clamped to sane bounds."""
    lo, hi = _MIN_CHUNK_TOKENS, _MAX_CHUNK_TOKENS
    if lat.prefill_ms(lo, _CHUNK_SEQ_TOKENS) > budget_ms:
        return lo
    if lat.prefill_ms(hi, _CHUNK_SEQ_TOKENS) > budget_ms:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if lat.prefill_ms(mid, _CHUNK_SEQ_TOKENS) <= budget_ms:
                lo = mid
            else:
                hi = mid
        hi = lo
    candidates = [int(_MIN_CHUNK_TOKENS * 2 ** (k / 8)) for k in range(200)
                  if _MIN_CHUNK_TOKENS * 2 ** (k / 8) < hi] + [hi]
    rate = {t: t / lat.prefill_ms(t, _CHUNK_SEQ_TOKENS) for t in candidates}
    best = max(rate.values())
    return min(t for t in candidates if rate[t] >= efficiency * best)


def check_template(t, n_layers: int) -> None:
    """A template the simulator can run: contiguous stages over all layers, whose nodes are its node multiset."""
    fix = "rebuild the template library (`coral templates build`) and re-plan."
    bounds = [(s.start, s.end) for s in t.stages]
    contiguous = (bool(bounds) and bounds[0][0] == 0 and bounds[-1][1] == n_layers
                  and all(a < b for a, b in bounds) and all(x[1] == y[0] for x, y in zip(bounds, bounds[1:])))
    if not contiguous:
        raise CoralError(f"template {t.template_id} has stages {bounds}, not contiguous layers 0..{n_layers}.", fix)
    staged = Counter(n for s in t.stages for n in s.nodes)
    if staged != Counter(t.nodes.as_dict()) or any(len(s.nodes) != len(s.shares) for s in t.stages):
        listed = ",".join(f"{k}x{n}" for n, k in sorted(staged.items()))
        raise CoralError(f"template {t.template_id} places nodes {listed} in its stages, not its node multiset "
                         f"{t.nodes}.", fix)


class _Stride:
    """Weighted round-robin by stride scheduling: the next pick is the smallest pass; ties go to the lower index.
    An entry of weight 0 is never picked, unless every weight is 0 (then all are picked alike)."""

    __slots__ = ("heap",)

    def __init__(self, weights: Sequence[float]) -> None:
        positive = any(w > 0 for w in weights)
        strides = [1.0 / w if w > 0 else (math.inf if positive else 1.0) for w in weights]
        self.heap = [(s, i, s) for i, s in enumerate(strides)]
        heapq.heapify(self.heap)

    def pick(self) -> int:
        p, i, s = self.heap[0]
        heapq.heapreplace(self.heap, (p + s, i, s))
        return i


class _Node:
    __slots__ = ("idx", "inst", "stage", "is_first", "is_last", "lat", "kv_cap", "kv_admit", "kv_used", "running",
                 "max_running", "chunk_tokens", "ready_groups", "ready_chunks", "pq", "busy", "start_pending",
                 "busy_ms", "iterations", "decode_seqs", "prefill_tokens", "preemptions", "nic_gbps", "tx",
                 "rx", "layer_start", "layer_end", "config")

    def __init__(self, idx, inst, stage, lat, nic_gbps, layer_start, layer_end, config, max_running, watermark) -> None:
        self.idx, self.inst, self.stage, self.lat = idx, inst, stage, lat
        self.is_first = stage == 0
        self.is_last = stage == inst.n_stages - 1
        self.kv_cap = float(lat.kv_capacity_tokens)
        self.kv_admit = self.kv_cap * (1.0 - watermark)
        self.kv_used = 0.0
        self.running = 0
        self.max_running = max_running
        self.chunk_tokens = _MIN_CHUNK_TOKENS
        self.ready_groups: list[_Group] = []
        self.ready_chunks: list[tuple[int, int, bool, int]] = []  # request, tokens, last, past
        self.pq: deque[list[int]] = deque()
        self.busy = False
        self.start_pending = False
        self.busy_ms = 0.0
        self.iterations = 0
        self.decode_seqs = 0
        self.prefill_tokens = 0
        self.preemptions = 0
        self.nic_gbps = nic_gbps
        self.tx: set[_Flow] = set()  # transfers in flight out of (into) the node
        self.rx: set[_Flow] = set()
        self.layer_start, self.layer_end, self.config = layer_start, layer_end, config


class _Instance:
    __slots__ = ("idx", "model", "phase", "region", "template_id", "usd_per_hour", "weight", "n_stages", "stages",
                 "pickers", "queue", "single_path", "paths", "batches", "candidate", "routed", "max_model_len")

    def __init__(self, idx, model, phase, region, template_id, usd_per_hour, weight, n_stages) -> None:
        self.idx, self.model, self.phase, self.region = idx, model, phase, region
        self.template_id, self.usd_per_hour, self.weight, self.n_stages = template_id, usd_per_hour, weight, n_stages
        self.stages: list[list[_Node]] = []
        self.candidate: Candidate  # set by the engine once the instance's routing weight is known
        self.routed = 0
        self.pickers: list[_Stride] = []
        self.queue: deque[int] = deque()
        self.single_path = True
        self.paths: dict[tuple[_Node, ...], tuple[_Node, ...]] = {}
        self.batches: dict[int, list[_Group]] = {}
        self.max_model_len = math.inf

    def path(self) -> tuple[_Node, ...]:
        """The scheduler's choice: one node per stage, weighted round-robin by share (one tuple per distinct path,
        so paths compare by identity)."""
        if self.single_path and self.paths:
            return next(iter(self.paths))
        chosen = tuple(nodes[p.pick()] for nodes, p in zip(self.stages, self.pickers))
        return self.paths.setdefault(chosen, chosen)


class _Group:
    """A decode micro-batch: sequences on one path moving through it together. `heap` holds (cycle at which the
    sequence finishes, request); `pending` holds (tokens left, request) of sequences that join at the first stage;
    `ctx` sums the members' contexts."""

    __slots__ = ("path", "size", "ctx", "cycle", "heap", "pending", "pending_ctx")

    def __init__(self, path, size, ctx, heap) -> None:
        self.path, self.size, self.ctx, self.cycle, self.heap = path, size, ctx, 0, heap
        self.pending: list[tuple[int, int]] = []
        self.pending_ctx = 0

    def absorb_pending(self) -> None:
        heap, cycle = self.heap, self.cycle
        for n_left, r in self.pending:
            heapq.heappush(heap, (cycle + n_left, r))
        self.size += len(self.pending)
        self.ctx += self.pending_ctx
        self.pending = []
        self.pending_ctx = 0


class _Flow:
    """A transfer in flight: bits left at `at_s`, its current rate and a version that outdates its older
    completion events; on landing, `handler(arg)` runs `delay_s` later."""

    __slots__ = ("seq", "src", "dst", "bits", "at_s", "bps", "cap_bps", "version", "delay_s", "handler", "arg",
                 "stream")

    def __init__(self, seq, src, dst, bits, now, cap_bps, delay_s, handler, arg, stream):
        self.seq, self.src, self.dst, self.bits, self.at_s, self.bps = seq, src, dst, bits, now, 0.0
        self.cap_bps, self.version, self.delay_s, self.handler, self.arg = cap_bps, 0, delay_s, handler, arg
        self.stream = stream

    def order(self) -> int:
        return self.seq


@dataclass(frozen=True)
class EngineOutput:
    """Raw per-request times and per-node counters of one run."""

    ttft_s: np.ndarray
    finish_s: np.ndarray
    scheduled_s: np.ndarray
    decode_admitted_s: np.ndarray
    status: np.ndarray
    routed: np.ndarray
    preemptions: np.ndarray
    nodes: list[dict]
    instances: list[dict]
    end_s: float
    events: int
    wall_s: float


class Engine:
    """One simulation run: a plan's instances, a latency model and a workload."""

    def __init__(self, plan: Plan, workload: Workload, latency: LatencyModel, *, config: SimConfig = SimConfig(),
                 link_gbps: float | None = None, model_specs: dict | None = None,
                 node_gbps: dict | None = None) -> None:
        """`node_gbps` overrides, per node configuration, the bandwidth a node sends and receives at (default:
        min(its NIC, `link_gbps`))."""
        self.cfg = config
        self.w = workload
        self.link_gbps = link_gbps if link_gbps else float("inf")
        specs = model_specs or {}
        self.specs = {m: specs.get(m) or get_model(m) for m in workload.models}
        self.act_bytes = {m: float(s.activation_bytes_per_token) for m, s in self.specs.items()}
        self.instances: list[_Instance] = []
        self.nodes: list[_Node] = []
        for pi in sorted(plan.instances, key=lambda p: (p.template.template_id, p.region)):
            t = pi.template
            if t.model not in self.specs:
                continue
            check_template(t, self.specs[t.model].n_layers)
            weight = instance_weight(t.phase, t.tokens_per_s, plan.demand_tokens_per_s, t.model)
            for k in range(pi.count):
                inst = _Instance(len(self.instances), t.model, t.phase, pi.region, t.template_id, pi.usd_per_hour,
                                 weight, len(t.stages))
                inst.candidate = Candidate((t.template_id, pi.region, k), t.model, t.phase, pi.region, weight)
                for s, stage in enumerate(t.stages):
                    row = []
                    for k_node, cfg_node in enumerate(stage.nodes):
                        lat = latency.stage(t.model, cfg_node, stage.layers)
                        gbps = (node_gbps or {}).get(cfg_node, min(node_spec(cfg_node).nic_gbps, self.link_gbps))
                        node = _Node(len(self.nodes), inst, s, lat, gbps, stage.start,
                                     stage.end, cfg_node, config.max_batch_seqs * len(t.stages), config.kv_watermark)
                        planned = stage.batches[k_node] if stage.batches and stage.batches[k_node] > 0 else None
                        node.chunk_tokens = config.prefill_chunk_tokens or planned or chunk_tokens_within(
                            lat, t.slo_ms / len(t.stages), config.prefill_efficiency)
                        row.append(node)
                        self.nodes.append(node)
                    inst.stages.append(row)
                    inst.pickers.append(_Stride(stage.shares))
                inst.single_path = all(len(r) == 1 for r in inst.stages)
                self._limit_context(inst)
                self.instances.append(inst)
        self.router = Router()
        self.admission = plan_admission(plan)
        self.candidates = {m: [i.candidate for i in self.instances if i.model == m] for m in workload.models}
        self.by_key = {i.candidate.key: i for i in self.instances}
        n = len(workload)
        self.model_names = [workload.models[k] for k in workload.model.tolist()]
        self.arrival = workload.arrival_s.tolist()
        self.prompt = workload.prompt_tokens.tolist()
        self.output = workload.output_tokens.tolist()
        self.ttft = [np.nan] * n
        self.finish = [np.nan] * n
        self.status = [UNFINISHED] * n
        self.routed = [False] * n
        self.path_of: list[tuple[_Node, ...] | None] = [None] * n
        self.decode_of: list[_Instance | None] = [None] * n
        self.prefill_path: list[tuple[_Node, ...] | None] = [None] * n
        self.kv_base = [0] * n  # KV tokens charged at (re)admission on each node of the path
        self.join_left = [0] * n  # tokens left when the request last joined a micro-batch
        self.kv_left = [0] * n  # KV transfers of a decode hand-off not landed yet
        self.flows = 0  # transfers started, numbering them for a reproducible order
        self.streams: dict[tuple[int, int], deque] = {}  # pipeline connections busy: messages queued behind
        self.redo = [-1] * n  # tokens left of a preempted request waiting to recompute, else -1
        self.adm_order = [0] * n
        self.preempted = [0] * n
        self.admissions = 0
        self.scheduled = [np.nan] * n  # when the first chunk of the prompt started on the entry instance
        self.decode_admitted = [np.nan] * n  # when a prefilled request was admitted by its decode instance

    def _limit_context(self, inst: _Instance) -> None:
        """vLLM's KV rule, per pipeline: every worker holds as many KV tokens as the smallest worker of its pipeline.
        A node of a data-parallel stage is limited by each other stage's largest node (some path through it reaches
        that one), so a one-path instance gets vLLM's minimum over all its workers and a one-stage instance keeps
        every node's own. Then the instance's `max_model_len`, which every node must hold below the watermark."""
        best = [max(n.kv_cap for n in row) for row in inst.stages]
        caps = [[min([n.kv_cap] + [b for t, b in enumerate(best) if t != s]) for n in row]
                for s, row in enumerate(inst.stages)]
        for row, row_caps in zip(inst.stages, caps):
            for n, cap in zip(row, row_caps):
                n.kv_cap = cap
                n.kv_admit = cap * (1.0 - self.cfg.kv_watermark)
        low = min(n.kv_admit for row in inst.stages for n in row)
        room = math.floor(low) if math.isfinite(low) else math.inf
        want = self.cfg.max_model_len
        if want is not None and want > room:
            raise CoralError(
                f"max_model_len {want} exceeds the {room} KV tokens instance {inst.idx} ({inst.template_id}, "
                f"{inst.model} {inst.phase}) holds below the watermark: vLLM would not start it.",
                f"lower max_model_len to at most {room}, or leave it unset to take the whole KV cache.")
        inst.max_model_len = room if want is None else want

    def run(self) -> EngineOutput:
        t0 = time.perf_counter()
        heap: list = []
        seq = 0
        horizon = self.w.duration_s + self.cfg.drain_s
        if len(self.arrival):
            heap.append((self.arrival[0], PRIO_ARRIVAL, 0, self._arrive, 0))
        events = 0
        now = 0.0
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            ev = pop(heap)
            now = ev[0]
            if now > horizon:
                break
            events += 1
            succ = ev[3](now, ev[4])
            if succ:
                for t, prio, fn, arg in succ:
                    seq += 1
                    push(heap, (t, prio, seq, fn, arg))
        return self._output(min(now, horizon), events, time.perf_counter() - t0)

    # Routing and admission.

    def _arrive(self, now: float, r: int):
        out = []
        nxt = r + 1
        if nxt < len(self.arrival):
            out.append((self.arrival[nxt], PRIO_ARRIVAL, self._arrive, nxt))
        model = self.model_names[r]
        if self.admission is not None and not self.admission.admit(model, now):
            self.status[r] = SHED
            return out
        route = self.router.route(model, self.candidates[model])
        if route is None:
            self.status[r] = NO_DECODE if self.candidates[model] else NO_INSTANCE
            return out
        self.routed[r] = True
        entry, decode = route
        decode_inst = self.by_key[decode.key] if decode is not None else None
        self.decode_of[r] = decode_inst
        self.by_key[entry.key].routed += 1
        if decode_inst is not None:
            decode_inst.routed += 1
        self._enqueue(self.by_key[entry.key], r, now, out)
        return out

    def _path(self, r: int) -> tuple[_Node, ...]:
        """The path request r was admitted on (`_enqueue` sets it before any stage sees r)."""
        path = self.path_of[r]
        if path is None:
            raise RuntimeError(f"request {r} has no path: it was never enqueued")
        return path

    def _enqueue(self, inst: _Instance, r: int, now: float, out: list) -> None:
        path = inst.path()
        need = self.prompt[r] + (1 if inst.phase == "prefill" else self.output[r])
        if need > inst.max_model_len:
            self.status[r] = TOO_LONG
            self._release_prefill(r, now, out)
            return
        self.path_of[r] = path
        inst.queue.append(r)
        self._admit(inst, now, out)

    def _admit(self, inst: _Instance, now: float, out: list) -> None:
        """Admit queued requests in order while every node of the head's path has KV room (FIFO, no overtaking).
        A decode or aggregated request needs its prompt and first token (a preempted one, all it had)."""
        q = inst.queue
        decodes = inst.phase != "prefill"
        while q:
            r = q[0]
            path = self._path(r)
            redo = self.redo[r]
            if not decodes:
                need = self.prompt[r]
            elif redo < 0:
                need = self.prompt[r] + 1
            else:
                need = self.prompt[r] + self.output[r] - redo
            for n in path:
                if n.kv_used + need > n.kv_admit or (decodes and n.running >= n.max_running):
                    return
            q.popleft()
            for n in path:
                n.kv_used += need
                if decodes:
                    n.running += 1
            self.kv_base[r] = need
            self.admissions += 1
            self.adm_order[r] = self.admissions
            head = path[0]
            # A prefill item is [request, tokens left, tokens done]; done ones are the past later chunks attend to.
            if redo >= 0:
                head.pq.append([r, need - 1, 0])  # recompute the prompt and the tokens generated before preemption
                self._wake(head, now, out)
            elif inst.phase == "decode":
                self.decode_admitted[r] = now
                self._kv_transfer(r, path, now, out)
            else:
                head.pq.append([r, self.prompt[r], 0])
                self._wake(head, now, out)

    def _wake(self, node: _Node, now: float, out: list) -> None:
        if not node.busy and not node.start_pending:
            node.start_pending = True
            out.append((now, PRIO_START, self._start, node))

    # Transfers.

    def _link(self, src: _Node, dst: _Node, nbytes: float, now: float, handler, arg, out: list,
              stream: bool = False) -> None:
        """Start sending `nbytes` from src to dst; `handler(arg)` runs when they land (module docstring). A `stream`
        message goes on the src → dst pipeline connection, after the ones already on it."""
        if stream:
            key = (src.idx, dst.idx)
            queued = self.streams.get(key)
            if queued is not None:
                queued.append((nbytes, handler, arg))
                return
            self.streams[key] = deque()
        cap_bps, delay_s = math.inf, 0.0
        if src.inst.region != dst.inst.region:
            cap_bps, delay_s = self.cfg.cross_region_gbps * 1e9, self.cfg.cross_region_latency_ms / 1000.0
        self.flows += 1
        f = _Flow(self.flows, src, dst, nbytes * 8.0, now, cap_bps, delay_s, handler, arg, stream)
        if nbytes <= 0:
            out.append((now, PRIO_TRANSFER, self._flow_done, (f, f.version)))
            return
        src.tx.add(f)
        dst.rx.add(f)
        self._rerate(src, dst, now, out)

    def _rerate(self, src: _Node, dst: _Node, now: float, out: list) -> None:
        """Re-share src's sending and dst's receiving bandwidth among their transfers; each whose rate changed gets
        a fresh completion event (the old one is outdated by the version)."""
        for f in sorted(src.tx | dst.rx, key=_Flow.order):
            bps = min(f.src.nic_gbps * 1e9 / len(f.src.tx), f.dst.nic_gbps * 1e9 / len(f.dst.rx), f.cap_bps)
            if bps == f.bps:
                continue
            if f.bps:
                f.bits = max(f.bits - f.bps * (now - f.at_s), 0.0)
            f.at_s, f.bps = now, bps
            f.version += 1
            out.append((now + f.bits / bps, PRIO_TRANSFER, self._flow_done, (f, f.version)))

    def _flow_done(self, now: float, arg):
        f, version = arg
        if version != f.version:
            return None
        f.src.tx.discard(f)
        f.dst.rx.discard(f)
        f.version += 1
        out: list = [(now + f.delay_s, PRIO_TRANSFER, f.handler, f.arg)]
        self._rerate(f.src, f.dst, now, out)
        if f.stream:  # the connection's next message, if any, goes now
            key = (f.src.idx, f.dst.idx)
            queued = self.streams.pop(key)
            if queued:
                nbytes, handler, arg = queued.popleft()
                self._link(f.src, f.dst, nbytes, now, handler, arg, out, stream=True)
                self.streams[key].extend(queued)
        return out

    def _kv_transfer(self, r: int, dst_path: tuple[_Node, ...], now: float, out: list) -> None:
        """Prefill nodes send each decode node the KV of the layers both hold, all pairs at once; r joins its
        micro-batch when the last lands."""
        src_path = self.prefill_path[r]
        if src_path is None:
            raise RuntimeError(f"request {r} reached decode with no prefill path: `_prefilled` sets it first")
        per_layer = self.specs[self.model_names[r]].kv_bytes_per_layer(self.prompt[r])
        pairs = []
        for src in src_path:
            for dst in dst_path:
                overlap = min(src.layer_end, dst.layer_end) - max(src.layer_start, dst.layer_start)
                if overlap > 0:
                    pairs.append((src, dst, overlap * per_layer))
        self.kv_left[r] = len(pairs)
        for src, dst, nbytes in pairs:
            self._link(src, dst, nbytes, now, self._kv_piece, r, out)

    def _kv_piece(self, now: float, r: int):
        self.kv_left[r] -= 1
        return self._kv_landed(now, r) if self.kv_left[r] == 0 else None

    def _kv_landed(self, now: float, r: int):
        out: list = []
        self._release_prefill(r, now, out)
        self._join(self._path(r), r, self.output[r] - 1, None, now, out)
        return out

    def _join(self, path: tuple[_Node, ...], r: int, n_left: int, tail: _Node | None, now: float, out: list) -> None:
        """Request r decodes its `n_left` tokens on `path`: a new micro-batch while the path has fewer than S,
        else it joins the smallest one. `tail` is the last stage that produced its latest token, if not the head."""
        inst = path[0].inst
        batches = inst.batches.setdefault(id(path), [])
        self.join_left[r] = n_left
        ctx = self.kv_base[r]
        if len(batches) >= inst.n_stages:
            g = min(batches, key=lambda b: b.size + len(b.pending))
            g.pending.append((n_left, r))
            g.pending_ctx += ctx
            return
        g = _Group(path, 1, ctx, [(n_left, r)])
        batches.append(g)
        head = path[0]
        if tail is None or tail is head:
            head.ready_groups.append(g)
            self._wake(head, now, out)
        else:
            self._send(tail, head, [g], None, _TOKEN_ID_BYTES, now, out)

    def _release_prefill(self, r: int, now: float, out: list) -> None:
        path = self.prefill_path[r]
        if path is None:
            return
        self.prefill_path[r] = None
        need = self.prompt[r]
        for n in path:
            n.kv_used -= need
        self._admit(path[0].inst, now, out)

    def _arrive_items(self, now: float, arg):
        node, groups, chunks = arg
        if groups:
            node.ready_groups.extend(groups)
        if chunks:
            node.ready_chunks.extend(chunks)
        if node.busy or node.start_pending:
            return None
        ev = self._begin(node, now)  # an idle node starts at once: transfers rarely land at the same instant
        return [ev] if ev else None

    # Node iterations.

    def _start(self, now: float, node: _Node):
        node.start_pending = False
        if node.busy:
            return None
        ev = self._begin(node, now)
        return [ev] if ev else None

    def _begin(self, node: _Node, now: float):
        # Take the ready lists and leave fresh ones: items landing during the iteration wait for the next.
        groups = node.ready_groups
        if groups:
            if len(groups) == 1:
                node.ready_groups = []
            else:  # one micro-batch per path per iteration; the others wait for the next one
                seen: set[int] = set()
                take, rest = [], []
                for g in groups:
                    key = id(g.path)
                    if key in seen:
                        rest.append(g)
                    else:
                        seen.add(key)
                        take.append(g)
                node.ready_groups = rest
                groups = take
            if node.is_first:
                for g in groups:
                    if g.pending:
                        g.absorb_pending()
        else:
            groups = []
        chunks = node.ready_chunks
        if chunks:
            node.ready_chunks = []
        else:
            chunks = []
        batch = 0
        ctx = 0
        for g in groups:
            batch += g.size
            ctx += g.ctx
        if node.pq:
            budget = node.chunk_tokens - batch
            seqs = self.cfg.max_batch_seqs - batch
            pq = node.pq
            scheduled = self.scheduled
            while pq and budget > 0 and seqs > 0:
                item = pq[0]
                take_tokens = item[1] if item[1] <= budget else budget
                item[1] -= take_tokens
                budget -= take_tokens
                seqs -= 1
                last = item[1] == 0
                if last:
                    pq.popleft()
                r = item[0]
                chunks.append((r, take_tokens, last, item[2]))
                item[2] += take_tokens
                if scheduled[r] != scheduled[r]:  # NaN: the prompt's first chunk
                    scheduled[r] = now
        tokens = 0
        square_tokens = 0
        past_tokens = 0
        for c in chunks:
            tokens += c[1]
            square_tokens += c[1] * c[1]
            past_tokens += c[1] * c[3]
        if not batch and not tokens:
            node.busy = False
            return None
        # One forward pass (vLLM's fused step); token-weighted chunk length and past (exact pair counts for full
        # attention).
        dt_ms = fused_step_ms(node.lat, batch, ctx, tokens, square_tokens // tokens if tokens else 1,
                              past_tokens / tokens if tokens else 0.0)
        node.busy = True
        node.busy_ms += dt_ms
        node.iterations += 1
        node.decode_seqs += batch
        node.prefill_tokens += tokens
        return (now + dt_ms / 1000.0, PRIO_DONE, self._done, (node, groups, chunks))

    def _done(self, now: float, arg):
        node, groups, chunks = arg
        node.busy = False
        out: list = []
        if node.is_last:
            freed: dict = {}  # ordered, so admission retries run in a reproducible order
            for g in groups:
                self._cycle(g, node, now, out, freed)
            for r, _, last, _ in chunks:
                if last:
                    self._prefilled(r, node, now, out, freed)
            for inst in freed:
                self._admit(inst, now, out)
        else:
            stage = node.stage + 1
            targets: dict[_Node, list] = {}
            for g in groups:
                nxt = g.path[stage]
                entry = targets.get(nxt)
                if entry is None:
                    targets[nxt] = entry = [[], [], 0]
                entry[0].append(g)
                entry[2] += g.size
            for c in chunks:
                nxt = self._path(c[0])[stage]
                entry = targets.get(nxt)
                if entry is None:
                    targets[nxt] = entry = [[], [], 0]
                entry[1].append(c)
                entry[2] += c[1]
            act = self.act_bytes[node.inst.model]
            for nxt, (gs, cs, ntok) in targets.items():
                self._send(node, nxt, gs, cs, ntok * act, now, out)
        ev = self._begin(node, now)
        if ev:
            out.append(ev)
        return out

    def _cycle(self, g: _Group, node: _Node, now: float, out: list, freed: dict) -> None:
        """A micro-batch left the last stage: every member has one more token; finish, grow KV, preempt."""
        g.cycle += 1
        g.ctx += g.size
        path = g.path
        for n in path:
            n.kv_used += g.size
        heap = g.heap
        while heap and heap[0][0] <= g.cycle:
            _, r = heapq.heappop(heap)
            g.size -= 1
            done_ctx = self.kv_base[r] + self.join_left[r]
            g.ctx -= done_ctx
            self._finish(r, now, freed, done_ctx)
        for n in path:
            while n.kv_used > n.kv_cap and g.size:
                self._preempt(g, n, freed)
        if g.size or g.pending:
            head = path[0]
            if head is node:
                node.ready_groups.append(g)
            else:
                self._send(node, head, [g], None, g.size * _TOKEN_ID_BYTES, now, out)
        else:
            path[0].inst.batches[id(path)].remove(g)

    def _preempt(self, g: _Group, node: _Node, freed: dict) -> None:
        """Free the most recently admitted member of `g` (vLLM's victim); it recomputes when readmitted."""
        heap = g.heap
        order = self.adm_order
        i = max(range(len(heap)), key=lambda k: order[heap[k][1]])
        fc, r = heap[i]
        heap[i] = heap[-1]
        heap.pop()
        heapq.heapify(heap)
        left = fc - g.cycle
        ctx = self.kv_base[r] + self.join_left[r] - left
        g.size -= 1
        g.ctx -= ctx
        for n in g.path:
            n.kv_used -= ctx
            n.running -= 1
        node.preemptions += 1
        self.preempted[r] += 1
        self.redo[r] = left
        inst = g.path[0].inst
        inst.queue.appendleft(r)
        freed[inst] = None

    def _send(self, src: _Node, dst: _Node, groups, chunks, nbytes: float, now: float, out: list) -> None:
        """Activations to the next stage, or sampled token ids from the last stage back to the first."""
        self._link(src, dst, nbytes, now, self._arrive_items, (dst, groups, chunks), out, stream=True)

    def _prefilled(self, r: int, tail: _Node, now: float, out: list, freed: dict) -> None:
        """The last chunk of r's prompt left the last stage: its first token exists (or a recompute is done)."""
        path = self._path(r)
        inst = path[0].inst
        if self.redo[r] >= 0:
            n_left, self.redo[r] = self.redo[r], -1
            self._join(path, r, n_left, tail, now, out)
            return
        self.ttft[r] = now
        if self.output[r] <= 1:
            self._finish(r, now, freed, self.kv_base[r])
            return
        if inst.phase == "aggregated":
            self._join(path, r, self.output[r] - 1, tail, now, out)
            return
        self.prefill_path[r] = path
        decode = self.decode_of[r]
        if decode is None:
            self.status[r] = NO_DECODE
            self._release_prefill(r, now, out)
            return
        self._enqueue(decode, r, now, out)

    def _finish(self, r: int, now: float, freed: dict, kv_tokens: float) -> None:
        """r is done: its path's nodes free `kv_tokens` each (and a running slot, past prefill)."""
        self.finish[r] = now
        self.status[r] = OK
        path = self._path(r)
        inst = path[0].inst
        decodes = inst.phase != "prefill"
        for n in path:
            n.kv_used -= kv_tokens
            if decodes:
                n.running -= 1
        freed[inst] = None

    def _output(self, end_s: float, events: int, wall_s: float) -> EngineOutput:
        nodes = [{
            "instance": n.inst.idx, "template_id": n.inst.template_id, "model": n.inst.model,
            "phase": n.inst.phase, "region": n.inst.region, "stage": n.stage, "node": str(n.config),
            "layers": n.layer_end - n.layer_start, "busy_s": n.busy_ms / 1000.0, "iterations": n.iterations,
            "mean_decode_batch": n.decode_seqs / n.iterations if n.iterations else 0.0,
            "prefill_tokens": n.prefill_tokens, "kv_capacity_tokens": n.kv_cap, "chunk_tokens": n.chunk_tokens,
            "preemptions": n.preemptions,
        } for n in self.nodes]
        instances = [{"instance": i.idx, "template_id": i.template_id, "model": i.model, "phase": i.phase,
                      "region": i.region, "usd_per_hour": i.usd_per_hour, "max_model_len": i.max_model_len,
                      "key": i.candidate.key, "routed_requests": i.routed} for i in self.instances]
        return EngineOutput(np.array(self.ttft, dtype=float), np.array(self.finish, dtype=float),
                            np.array(self.scheduled, dtype=float), np.array(self.decode_admitted, dtype=float),
                            np.array(self.status, dtype=np.int8), np.array(self.routed, dtype=bool),
                            np.array(self.preempted, dtype=np.int32), nodes, instances, end_s, events, wall_s)
