"""The vLLM engine: one serving instance as vLLM's own pipeline, streaming tokens with continuous batching.

vLLM runs one pipeline over separately started nodes with its multiprocessing executor: every node runs
`vllm serve M -tp T -pp P --nnodes N --node-rank i --master-addr HEAD` with `VLLM_PP_LAYER_PARTITION` set,
the others `--headless`. The head (rank 0) here is Coral's engine node, which builds vLLM's engine in-process
from the very same command line (parsed by vLLM's own parser), so the head and the headless nodes cannot
disagree. Each request is submitted once with its prompt and output budget; tokens stream out step by step.

A prefill or decode instance of a PD pair runs with `--kv-transfer-config` (`templates/engines.py`). Its prefill
requests ask for one token with `PREFILL_KV_PARAMS` (what vLLM's disaggregated proxy example,
`examples/online_serving/disaggregated_serving/…/toy_proxy_server.py`, sends a prefill instance) and answer with the
`kv_transfer_params` vLLM returns (NixlConnector: where the decode instance pulls the blocks from; ExampleConnector:
none, the KV lies in shared storage keyed by the prompt). The decode instance then runs the prompt and the first
token with those parameters: its connector loads the prompt's KV (both connectors load all but the last token of
a decode request's prompt: `ExampleConnector.get_num_new_matched_tokens`, NIXL's remote prefill token count), so
only the first token is computed and decoding continues from the token the client already has.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from coral_dagster.errors import CoralError
from coral_dagster.runtime.engine import Engine, Step, StepOutput
from coral_dagster.runtime.sampling import SamplingParams, TokenLogprobs

#: What a prefill request of a PD pair carries (vLLM's toy_proxy_server.py, `send_request_to_service`).
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass(frozen=True)
class VllmLaunch:
    """Everything one vLLM node of an instance is started with; `argv(rank)` is its `vllm serve` line."""

    model: str
    split: tuple[int, ...]
    tp: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    enforce_eager: bool = False
    # `--kv-transfer-config` JSON of a PD instance (every rank builds the connector); "" for an aggregated one.
    kv_transfer_config: str = ""

    @property
    def nnodes(self) -> int:
        return len(self.split)

    def env(self) -> dict[str, str]:
        """Environment every node of the instance needs: the layer split, as vLLM validates it."""
        return {"VLLM_PP_LAYER_PARTITION": ",".join(str(n) for n in self.split)}

    def argv(self, node_rank: int) -> list[str]:
        """`vllm serve …` for node `node_rank`: rank 0 serves, the others are headless workers."""
        if not 0 <= node_rank < self.nnodes:
            raise CoralError(f"node rank {node_rank} is outside this {self.nnodes}-node instance.",
                             f"pick a rank in 0..{self.nnodes - 1}")
        args = ["vllm", "serve", self.model, "--tensor-parallel-size", str(self.tp),
                "--pipeline-parallel-size", str(len(self.split)), "--distributed-executor-backend", "mp",
                "--max-model-len", str(self.max_model_len),
                "--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}", "--dtype", self.dtype,
                "--skip-tokenizer-init", "--generation-config", "vllm"]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.kv_transfer_config:
            args += ["--kv-transfer-config", self.kv_transfer_config]
        if self.nnodes > 1:
            args += ["--nnodes", str(self.nnodes), "--node-rank", str(node_rank),
                     "--master-addr", self.master_addr, "--master-port", str(self.master_port)]
        if node_rank > 0:
            args.append("--headless")
        return args


def parse_serve_line(argv: Sequence[str]):
    """(vLLM's `serve` subcommand, its parsed arguments) for a `vllm serve …` line, by vLLM's own parser: the
    one `vllm serve` builds (its `vllm` launcher cannot run from the CPU build, which lacks the `vllm`
    distribution name its version flag reads)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if list(argv[:2]) != ["vllm", "serve"]:
        raise CoralError(f"{' '.join(argv[:2])!r} is not a `vllm serve` line.", "build it with VllmLaunch.argv")
    parser = FlexibleArgumentParser(prog="vllm")
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(list(argv[1:]))
    command.validate(args)
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    return command, args


def engine_args(argv: Sequence[str]):
    """vLLM's `EngineArgs` from a `vllm serve …` line."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs.from_cli_args(parse_serve_line(argv)[1])


def run_serve_line(argv: Sequence[str]) -> None:
    """Run a `vllm serve …` line in this process, as the `vllm` launcher would (a headless worker blocks here)."""
    command, args = parse_serve_line(argv)
    command.cmd(args)


class VllmEngine(Engine):
    """The head of a vLLM instance: requests go in once, then `step()` returns the tokens each one produced.

    An `Engine` for the parts an engine node reads (`is_first`, `check_step`, `cache_length`, `free`); it does not
    run Coral's per-step forwards nor hand KV over layer by layer, and it holds every layer (vLLM places the stages
    on the instance's nodes).
    """

    max_context: int

    def __init__(self, launch: VllmLaunch, n_layers: int, vocab: int) -> None:
        if sum(launch.split) != n_layers:
            raise CoralError(f"{sum(launch.split)=} does not match {n_layers=} of {launch.model}.",
                             "make the vLLM layer split add up to the model's layers")
        try:
            from vllm import LLMEngine
        except ImportError:
            raise CoralError("vLLM is not installed on this node.",
                             "run sky_tasks/setup_node.sh (CORAL_VLLM_SPEC picks the build) or use --engine torch"
                             ) from None
        os.environ.update(launch.env())
        self.launch, self.start, self.end, self.n_layers, self.vocab = launch, 0, n_layers, n_layers, vocab
        self.max_context = launch.max_model_len
        # vLLM's own share of its KV block pool in use (`SchedulerStats.kv_cache_usage`), as its scheduler last
        # reported it to the stat loggers.
        self.kv_cache_usage = 0.0
        self.llm = LLMEngine.from_engine_args(engine_args(launch.argv(0)), stat_loggers=[self._stat_logger()])
        self._length: dict[str, int] = {}
        # Alternatives each request asked log-probabilities of, for its outputs and for its prompt.
        self._top: dict[str, int] = {}
        self._prompt_top: dict[str, int] = {}
        # PD prefill requests running, and the `kv_transfer_params` vLLM finished each with ({}: none) until read.
        self._prefills: set[str] = set()
        self.kv_params: dict[str, dict] = {}
        # The prompt's log-probabilities (positions 1..) vLLM reported for a request, until read.
        self.prompt_logprobs: dict[str, list[TokenLogprobs]] = {}

    def submit(self, rid: str, prompt: np.ndarray, max_tokens: int, sampling: SamplingParams | None = None,
               kv_transfer_params: dict | None = None) -> None:
        """Queue `rid` with its prompt under `sampling` (greedy when None); EOS left to the scheduler's stop rule.
        `kv_transfer_params` go to the instance's KV connector (a PD pair's prefill or decode request)."""
        tokens = [int(t) for t in np.asarray(prompt)]
        if not tokens:
            raise ValueError(f"request {rid}: the prompt is empty")
        self.check_step(Step(rid, 0, tokens=np.asarray(prompt)))
        if len(tokens) + max_tokens > self.max_context:
            # vLLM would stop at max_model_len short of max_tokens, and the scheduler wait for tokens never sent.
            raise ValueError(f"request {rid}: {len(tokens)} prompt tokens + {max_tokens=} exceed vLLM's "
                             f"max_model_len={self.max_context}")
        sampling = sampling or SamplingParams()
        params = sampling.vllm(max_tokens)
        if kv_transfer_params is not None:
            # vLLM's Request reads them from here (`vllm/v1/request.py`).
            params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": kv_transfer_params}
            if kv_transfer_params.get("do_remote_decode"):
                self._prefills.add(rid)
            else:
                # A decode request's prompt is the prefill instance's to report (its KV is loaded, not computed).
                params.prompt_logprobs = None
        self.llm.add_request(rid, {"prompt_token_ids": tokens}, params)
        self._length[rid] = len(tokens)
        self._top[rid] = sampling.logprobs or 0
        self._prompt_top[rid] = sampling.prompt_logprobs or 0

    def has_work(self) -> bool:
        return self.llm.has_unfinished_requests()

    def step(self) -> list[tuple[str, int, int, TokenLogprobs | None]]:
        """One engine step: (request, token, positions now known, log-probabilities when asked) for every token
        it produced, in order."""
        out = []
        for o in self.llm.step():
            if o.prompt_logprobs and o.prompt_token_ids:
                # vLLM's list starts with None (the first prompt token has no log-probability).
                self.prompt_logprobs[o.request_id] = [
                    _logprobs(position, int(token), self._prompt_top[o.request_id])
                    for position, token in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
            completion = o.outputs[0] if o.outputs else None
            for i, token in enumerate(completion.token_ids if completion else ()):
                self._length[o.request_id] = self._length.get(o.request_id, 0) + 1
                logprobs = completion.logprobs if completion else None
                out.append((o.request_id, int(token), self._length[o.request_id],
                            _logprobs(logprobs[i], int(token), self._top[o.request_id]) if logprobs else None))
            if o.finished:
                if o.request_id in self._prefills:
                    self._prefills.discard(o.request_id)
                    self.kv_params[o.request_id] = o.kv_transfer_params or {}
                self._length.pop(o.request_id, None)
                self._top.pop(o.request_id, None)
                self._prompt_top.pop(o.request_id, None)
        return out

    def kv_cache_tokens(self) -> int:
        """Tokens of KV cache vLLM allotted (blocks × block size), the same on every worker."""
        cache = self.llm.vllm_config.cache_config
        return int(cache.num_gpu_blocks) * int(cache.block_size)

    def kv_usage(self) -> tuple[int, int]:
        """vLLM's KV use (its block pool's used share, as tokens) and capacity; none held once no request is left
        (vLLM reports its use only from a step, and none follows the last request's end or abort)."""
        capacity = self.kv_cache_tokens()
        return round(self.kv_cache_usage * capacity) if self.has_work() else 0, capacity

    def _stat_logger(self):
        """A vLLM stat logger factory whose logger keeps the scheduler's KV usage on this engine."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        engine = self

        class KvUsage(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    engine.kv_cache_usage = float(scheduler_stats.kv_cache_usage)

            def log_engine_initialized(self) -> None:
                pass

        return KvUsage

    def held_layers(self) -> list[list[int]]:
        """Per pipeline rank, the decoder layers its worker holds (vLLM leaves `PPMissingLayer` elsewhere).

        The callable travels to every worker pickled: vLLM needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 for it.
        """
        return self.llm.collective_rpc(_held_layers)

    def cache_length(self, rid: str) -> int | None:
        return 0 if rid not in self._length else self._length[rid]

    def forward(self, steps: list[Step]) -> list[StepOutput]:
        raise _not_per_step()

    def export_kv(self, rid: str, start: int, end: int) -> list[np.ndarray]:
        raise _not_per_step()

    def import_kv(self, rid: str, start: int, end: int, arrays: list[np.ndarray]) -> None:
        raise _not_per_step()

    def free(self, rid: str) -> None:
        self._top.pop(rid, None)
        self._prompt_top.pop(rid, None)
        self.prompt_logprobs.pop(rid, None)
        self._prefills.discard(rid)
        self.kv_params.pop(rid, None)
        if self._length.pop(rid, None) is not None:
            self.llm.abort_request([rid])


def _not_per_step() -> CoralError:
    return CoralError("a vLLM instance streams whole requests; it runs no per-step forwards and hands no KV over "
                      "layer by layer.", "send it one forward per request from position 0 (`VllmNode`)")


def _logprobs(position: dict, token: int, k: int) -> TokenLogprobs:
    """vLLM's log-probabilities of one position (token id -> Logprob: the k most likely, ranks 1..k, and the
    sampled or prompt token at its own rank) as Coral's."""
    top = sorted((lp.rank, t, float(lp.logprob)) for t, lp in position.items() if lp.rank is not None and lp.rank <= k)
    return TokenLogprobs(float(position[token].logprob), tuple((t, lp) for _, t, lp in top), position[token].rank)


def _held_layers(worker) -> list[int]:
    layers = worker.model_runner.model.model.layers
    return [i for i, m in enumerate(layers) if type(m).__name__ != "PPMissingLayer"]


def vllm_model(model: str) -> tuple[str, int, int, str]:
    """(what `vllm serve` loads, layers, vocabulary, dtype): a tiny decoder exported as a Hugging Face directory
    in float32 (the torch engine's weights), else the catalog model's Hugging Face id."""
    from coral_dagster.runtime.tiny import TINY_PREFIX, decoder_config

    if model.lower().startswith(TINY_PREFIX):
        from coral_dagster.runtime.hf_export import export_tiny

        cfg = decoder_config(model)
        return str(export_tiny(model)), cfg.n_layers, cfg.vocab, cfg.dtype
    from coral_dagster.catalog.models import get_model

    spec = get_model(model)
    return spec.hf_id, spec.n_layers, spec.vocab, "auto"


def head_engine(model: str, split: tuple[int, ...], **launch) -> VllmEngine:
    """The vLLM head (node rank 0) for `model` split as `split` (default: one stage); `launch` as VllmLaunch."""
    path, n_layers, vocab, dtype = vllm_model(model)
    return VllmEngine(VllmLaunch(path, split or (n_layers,), dtype=dtype, **launch), n_layers, vocab)
