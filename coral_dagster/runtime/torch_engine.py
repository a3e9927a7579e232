"""The torch engine: a slice of a Llama-style decoder with per-request KV caches, on CPU or CUDA."""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from coral_dagster.runtime.engine import Engine, Step, StepOutput, validate_layers
from coral_dagster.runtime.sampling import SamplingParams, TokenLogprobs
from coral_dagster.runtime.structured import Guides
from coral_dagster.runtime.tiny import DecoderConfig
from coral_dagster.runtime.tokenizer import EOS

KV = tuple[torch.Tensor, torch.Tensor]
# Share of the memory free once the weights are in place that the KV cache may take (vLLM's default
# `gpu_memory_utilization`): the torch engine's KV capacity, as vLLM sizes its block pool at start.
KV_MEMORY_FRACTION = 0.9


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer; matrices are `[out, in]` as in `torch.nn.Linear`."""

    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


def _generator(cfg: DecoderConfig, part: str) -> torch.Generator:
    """A CPU generator seeded by (model seed, part), so every process builds the same weights for a part."""
    return torch.Generator().manual_seed(zlib.crc32(f"{cfg.name}:{cfg.seed}:{part}".encode()))


def _matrix(g: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=g) / math.sqrt(cols)


def _norm(g: torch.Generator, size: int) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(size, generator=g)


def layer_weights(cfg: DecoderConfig, layer: int) -> LayerWeights:
    """Layer `layer`'s random weights, identical in every process (CPU float32)."""
    g = _generator(cfg, f"layer{layer}")
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return LayerWeights(
        attn_norm=_norm(g, cfg.hidden), wq=_matrix(g, q, cfg.hidden), wk=_matrix(g, kv, cfg.hidden),
        wv=_matrix(g, kv, cfg.hidden), wo=_matrix(g, cfg.hidden, q), mlp_norm=_norm(g, cfg.hidden),
        w_gate=_matrix(g, cfg.intermediate, cfg.hidden), w_up=_matrix(g, cfg.intermediate, cfg.hidden),
        w_down=_matrix(g, cfg.hidden, cfg.intermediate))


def embedding_weights(cfg: DecoderConfig) -> torch.Tensor:
    return torch.randn(cfg.vocab, cfg.hidden, generator=_generator(cfg, "embed"))


def head_weights(cfg: DecoderConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(final norm, LM head `[vocab, hidden]`)."""
    g = _generator(cfg, "head")
    return _norm(g, cfg.hidden), _matrix(g, cfg.vocab, cfg.hidden)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(var + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int) -> torch.Tensor:
    """Causal attention of `n` new queries `[n, heads, d]` at positions `pos..` over cached keys `[kv_heads, L, d]`."""
    n, heads, d = q.shape
    group = heads // k.shape[0]
    keys, values = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = q.transpose(0, 1) @ keys.transpose(1, 2) / math.sqrt(d)
    if n > 1:
        allowed = torch.arange(keys.shape[1], device=q.device)[None, :] <= (
            pos + torch.arange(n, device=q.device))[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return (probs @ values).transpose(0, 1).reshape(n, heads * d)


def sample(logits: torch.Tensor, params: list[SamplingParams | None], positions: list[int],
           outputs: list[list[int]] | None = None,
           allowed: list[torch.Tensor | None] | None = None) -> list[tuple[int, TokenLogprobs | None]]:
    """One token per row of `logits` (`[n, vocab]`, float32) under its request's parameters (None: greedy), drawn
    for output position `positions[i]` after the tokens `outputs[i]` it generated so far (what penalties count);
    with its raw log-probabilities when asked (before penalties, as vLLM's `raw_logprobs`)."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for i, (row, p, pos, best) in enumerate(zip(logits, params, positions, greedy)):
        p = p or SamplingParams()
        adjusted = penalised(row, p, pos, outputs[i] if outputs else [])
        mask = allowed[i] if allowed else None
        if mask is not None:
            # The grammar's mask (structured outputs) comes last, as vLLM applies it.
            adjusted = adjusted.masked_fill(~mask.to(adjusted.device), float("-inf"))
        if adjusted is not row:
            best = int(adjusted.argmax())
        token = best if p.greedy else _draw(adjusted, p, pos)
        lp = None
        if p.logprobs is not None:
            logp = torch.log_softmax(row, dim=-1)
            values, ids = logp.topk(p.logprobs)
            lp = TokenLogprobs(float(logp[token]), tuple(zip(map(int, ids.tolist()), map(float, values.tolist()))))
        out.append((int(token), lp))
    return out


def prompt_logprobs(logp: torch.Tensor, targets: tuple[int, ...], k: int) -> list[TokenLogprobs]:
    """Each target's log-probability under its row of `logp` (`[n, vocab]`), its rank (vLLM's: how many tokens are
    at least as likely, itself included) and the `k` most likely tokens there."""
    ids = torch.tensor(targets, dtype=torch.long, device=logp.device)[:, None]
    chosen = logp.gather(1, ids)
    ranks = (logp >= chosen).sum(dim=1).tolist()
    values, top = logp.topk(k, dim=-1)
    return [TokenLogprobs(float(c), tuple(zip(map(int, t), map(float, v))), int(r))
            for c, t, v, r in zip(chosen[:, 0].tolist(), top.tolist(), values.tolist(), ranks)]


def penalised(row: torch.Tensor, p: SamplingParams, pos: int, outputs: list[int]) -> torch.Tensor:
    """`row` under vLLM's penalties and `min_tokens` (`row` itself when none applies), for the token drawn at
    position `pos` after `outputs` (vllm/model_executor/layers/utils.py `apply_penalties`, then the min-tokens
    logits processor)."""
    holding = pos - p.prompt_len < p.min_tokens
    if not (p.penalised or holding):
        return row
    row = row.clone()
    vocab = row.numel()
    if p.repetition_penalty != 1:
        seen = torch.tensor(sorted({t for t in (*p.prompt_token_ids, *outputs) if t < vocab}), dtype=torch.long)
        if seen.numel():
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if outputs and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(torch.tensor(outputs, dtype=torch.long), minlength=vocab)[:vocab].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    if holding:
        row[[t for t in (EOS, *p.stop_token_ids) if t < vocab]] = float("-inf")
    return row


def _draw(row: torch.Tensor, p: SamplingParams, pos: int) -> int:
    """A draw from `row / temperature` cut to the top-k tokens and then to the top-p nucleus (vLLM's order)."""
    scaled = (row / p.temperature).cpu()
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if p.keep_k and p.keep_k < scaled.numel():
        keep &= scaled >= scaled.topk(p.keep_k).values[-1]
    probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    if p.top_p < 1:
        ordered, order = probs.sort(descending=True)
        # A token stays while the mass before it is under top_p: the most likely always stays.
        before = ordered.cumsum(0) - ordered
        probs = torch.zeros_like(probs).scatter(0, order, ordered.masked_fill(before >= p.top_p, 0.0))
    generator = torch.Generator().manual_seed(p.draw_seed(pos))
    return int(torch.multinomial(probs, 1, generator=generator))


class TorchEngine(Engine):
    """Layers `[start, end)` of a `DecoderConfig`; requests are batched through every matrix multiply."""

    def __init__(self, cfg: DecoderConfig, start: int, end: int, device: str | None = None,
                 cpu_threads: int | None = 1, kv_capacity_tokens: int | None = None) -> None:
        validate_layers(start, end, cfg.n_layers)
        self.cfg, self.start, self.end, self.n_layers, self.vocab = cfg, start, end, cfg.n_layers, cfg.vocab
        self.max_context = cfg.max_context
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cpu" and cpu_threads:
            # Small CPU matmuls lose more to thread hand-offs than they gain; one thread is several times faster.
            torch.set_num_threads(cpu_threads)
        self.dtype = getattr(torch, cfg.dtype)
        move = self._move
        self.layers = [LayerWeights(**{f: move(getattr(w, f)) for f in LayerWeights.__dataclass_fields__})
                       for w in (layer_weights(cfg, i) for i in range(start, end))]
        self.embed = move(embedding_weights(cfg)) if self.is_first else None
        self.final_norm: torch.Tensor | None = None
        self.lm_head: torch.Tensor | None = None
        if self.is_last:
            norm, head = head_weights(cfg)
            self.final_norm, self.lm_head = move(norm), move(head)
        d = cfg.head_dim
        self.inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=self.device) / d)
        self._cache: dict[str, list[KV | None]] = {}
        # Tokens the last stage sampled per request, kept for requests with penalties (what they count).
        self._outputs: dict[str, list[int]] = {}
        self.guides = Guides(cfg.vocab)
        # Tokens of KV this node's layers may hold (given, as vLLM's `--num-gpu-blocks-override`, or from memory).
        self.kv_capacity_tokens = kv_capacity_tokens or self._memory_kv_tokens()

    def kv_bytes_per_token(self) -> int:
        """K and V of one position in this node's layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * len(self.layers) * self.cfg.n_kv_heads * self.cfg.head_dim * itemsize

    def _memory_kv_tokens(self) -> int:
        """Positions the memory free now (after the weights) holds at `KV_MEMORY_FRACTION`: the device's on CUDA,
        the machine's available RAM on CPU. The engine allots nothing up front; this is the bound its caches meet."""
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return max(1, int(free * KV_MEMORY_FRACTION) // self.kv_bytes_per_token())

    def kv_usage(self) -> tuple[int, int]:
        """Positions cached over all requests (per local layer, a partial handoff counted by its share of layers)
        and the capacity."""
        held = sum(kv[0].shape[1] for layers in self._cache.values() for kv in layers if kv is not None)
        return held // len(self.layers), self.kv_capacity_tokens

    def _move(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype)

    def to_wire(self, t: torch.Tensor) -> np.ndarray:
        t = t.detach().contiguous().cpu()
        return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()

    def from_wire(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.array(a))
        if self.dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        return t.to(device=self.device, dtype=self.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None, :].to(self.dtype), emb.sin()[:, None, :].to(self.dtype)

    def cache_length(self, rid: str) -> int | None:
        layers = self._cache.get(rid)
        if layers is None:
            return 0
        cached = [kv for kv in layers if kv is not None]
        if len(cached) != len(layers):
            return None
        return int(cached[0][0].shape[1])

    def _check_steps(self, steps: list[Step]) -> None:
        if len({s.rid for s in steps}) != len(steps):
            raise ValueError("a batch holds at most one step per request")
        for s in steps:
            have = self.cache_length(s.rid)
            if have != s.pos:
                raise ValueError(f"request {s.rid}: step at position {s.pos} but {have} positions are cached")
            self.check_step(s)

    @torch.inference_mode()
    def forward(self, steps: list[Step]) -> list[StepOutput]:
        if not steps:
            return []
        self._check_steps(steps)
        cfg = self.cfg
        sizes = [s.n_tokens for s in steps]
        if self.is_first:
            if self.embed is None:
                raise RuntimeError("the first stage holds no embedding")
            ids = torch.from_numpy(np.concatenate([np.asarray(s.tokens, dtype=np.int64) for s in steps]))
            x = self.embed[ids.to(self.device)]
        else:
            hidden = [s.hidden for s in steps if s.hidden is not None]
            if len(hidden) != len(steps):
                raise RuntimeError("a step after the first stage carries no hidden states")
            x = torch.cat([self.from_wire(a) for a in hidden])
        positions = torch.cat([torch.arange(s.pos, s.pos + n) for s, n in zip(steps, sizes)]).to(self.device)
        cos, sin = self._rope(positions)
        for s in steps:
            self._cache.setdefault(s.rid, [None] * len(self.layers))
        for li, w in enumerate(self.layers):
            h = rms_norm(x, w.attn_norm, cfg.norm_eps)
            q = F.linear(h, w.wq).view(-1, cfg.n_heads, cfg.head_dim)
            k = F.linear(h, w.wk).view(-1, cfg.n_kv_heads, cfg.head_dim)
            v = F.linear(h, w.wv).view(-1, cfg.n_kv_heads, cfg.head_dim)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            out = torch.empty(x.shape[0], cfg.n_heads * cfg.head_dim, dtype=x.dtype, device=x.device)
            offset = 0
            for s, n in zip(steps, sizes):
                rows = slice(offset, offset + n)
                keys, values = self._append(s.rid, li, k[rows].transpose(0, 1), v[rows].transpose(0, 1))
                out[rows] = attention(q[rows], keys, values, s.pos)
                offset += n
            x = x + F.linear(out, w.wo)
            h = rms_norm(x, w.mlp_norm, cfg.norm_eps)
            x = x + F.linear(F.silu(F.linear(h, w.w_gate)) * F.linear(h, w.w_up), w.w_down)
        ends = np.cumsum(sizes)
        if not self.is_last:
            return [StepOutput(s.rid, hidden=self.to_wire(x[e - n:e])) for s, n, e in zip(steps, sizes, ends)]
        if self.final_norm is None or self.lm_head is None:
            raise RuntimeError("the last stage holds no head weights")
        last = rms_norm(x[torch.as_tensor(ends - 1, device=self.device)], self.final_norm, cfg.norm_eps)
        logits = F.linear(last, self.lm_head).float()
        outputs = [self._outputs.setdefault(s.rid, []) if s.sampling is not None and s.sampling.penalised else []
                   for s in steps]
        allowed = [self.guides.allowed(s.rid, s.sampling.structured)
                   if s.sampling is not None and s.sampling.structured else None for s in steps]
        sampled = sample(logits, [s.sampling for s in steps], [s.pos + s.n_tokens for s in steps], outputs, allowed)
        for s, (token, _) in zip(steps, sampled):
            if s.sampling is not None and s.sampling.penalised:
                self._outputs[s.rid].append(token)
            if s.sampling is not None and s.sampling.structured:
                self.guides.advance(s.rid, token)
        prompt = [self._prompt_logprobs(x[e - n:e], s) for s, n, e in zip(steps, sizes, ends)]
        return [StepOutput(s.rid, token=token, logprobs=lp, prompt_logprobs=p)
                for s, (token, lp), p in zip(steps, sampled, prompt)]

    def _prompt_logprobs(self, x: torch.Tensor, step: Step) -> list[TokenLogprobs] | None:
        """The log-probabilities of `step.targets` from the step's last-layer states `x` (row i predicts target i),
        when its sampling asks for the prompt's."""
        k = step.sampling.prompt_logprobs if step.sampling is not None else None
        if k is None or not step.targets or self.final_norm is None or self.lm_head is None:
            return None
        rows = rms_norm(x[:len(step.targets)], self.final_norm, self.cfg.norm_eps)
        return prompt_logprobs(torch.log_softmax(F.linear(rows, self.lm_head).float(), dim=-1), step.targets, k)

    def _append(self, rid: str, li: int, k: torch.Tensor, v: torch.Tensor) -> KV:
        kv = self._cache[rid][li]
        if kv is not None:
            k, v = torch.cat((kv[0], k), dim=1), torch.cat((kv[1], v), dim=1)
        self._cache[rid][li] = (k, v)
        return k, v

    def export_kv(self, rid: str, start: int, end: int) -> list[np.ndarray]:
        self.check_range(start, end)
        layers = [kv for kv in self._cache[rid][start - self.start:end - self.start] if kv is not None]
        if len(layers) != end - start:
            raise RuntimeError(f"request {rid}: layers [{start}, {end}) are not all cached")
        return [self.to_wire(t) for kv in layers for t in kv]

    def import_kv(self, rid: str, start: int, end: int, arrays: list[np.ndarray]) -> None:
        self.check_range(start, end)
        if len(arrays) != 2 * (end - start):
            raise ValueError(f"KV for layers [{start}, {end}) needs {2 * (end - start)} arrays, got {len(arrays)}")
        layers = self._cache.setdefault(rid, [None] * len(self.layers))
        for i in range(end - start):
            layers[start - self.start + i] = (self.from_wire(arrays[2 * i]), self.from_wire(arrays[2 * i + 1]))

    def free(self, rid: str) -> None:
        self._cache.pop(rid, None)
        self._outputs.pop(rid, None)
        self.guides.free(rid)
