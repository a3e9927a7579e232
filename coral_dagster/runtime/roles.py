"""What each runtime process runs until it stops: the coordinator, a scheduler, an engine node, a headless vLLM rank."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

from coral_dagster.catalog.models import get_model
from coral_dagster.errors import CoralError
from coral_dagster.runtime import credentials
from coral_dagster.runtime.config import CoordinatorConfig, NodeSettings, SchedulerConfig
from coral_dagster.runtime.limits import ModelLimits
from coral_dagster.runtime.protocol import Env
from coral_dagster.runtime.security import CurveKeys
from coral_dagster.runtime.tiny import TINY_PREFIX, decoder_config


def model_layers(model: str) -> int:
    """Layers of a runtime model: a tiny decoder's, else the catalog model's."""
    if model.lower().startswith(TINY_PREFIX):
        return decoder_config(model).n_layers
    return get_model(model).n_layers


def model_limits(model: str) -> ModelLimits:
    """Vocabulary and context of a runtime model (a catalog model's context is its engine's to check)."""
    if model.lower().startswith(TINY_PREFIX):
        cfg = decoder_config(model)
        return ModelLimits(cfg.vocab, cfg.max_context)
    return ModelLimits(get_model(model).vocab)


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def stop_on_signals(first: threading.Event, second: threading.Event | None = None) -> None:
    """SIGTERM/SIGINT set `first`; a repeated signal sets `second` (e.g. drain, then stop)."""
    def handler(signum: int, frame: Any) -> None:
        (second if second is not None and first.is_set() else first).set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def say(as_json: bool, data: dict[str, Any], text: str) -> None:
    print(json.dumps(data) if as_json else text, flush=True)


def run_coordinator(cfg: CoordinatorConfig, insecure: bool = False, as_json: bool = False) -> None:
    """Route requests over ready instances and serve the HTTP front door until SIGTERM."""
    from coral_dagster.runtime.coordinator import Coordinator

    _setup_logging()
    coord = Coordinator(cfg, keys=CurveKeys.from_env(), insecure=insecure,
                        registration_key=credentials.from_env(Env.REGISTRATION_KEY))
    stop = threading.Event()
    stop_on_signals(stop)
    http = f"http://{cfg.http_host}:{coord.http.port}" if coord.http else None
    say(as_json, {"role": "coordinator", "listen": coord.address, "http": http},
         f"coordinator on {coord.address}" + (f", HTTP front door on {http}" if http else ""))
    coord.run(stop)


def run_scheduler(cfg: SchedulerConfig, insecure: bool = False, as_json: bool = False) -> None:
    """Drive one instance's engine nodes; the first SIGTERM drains, a second one stops at once."""
    from coral_dagster.runtime.scheduler import Scheduler

    _setup_logging()
    sched = Scheduler(cfg, keys=CurveKeys.from_env(), insecure=insecure,
                      credential=credentials.from_env(Env.INSTANCE_CREDENTIAL))
    stop = threading.Event()
    drain = threading.Event()
    stop_on_signals(drain, stop)

    def drain_when_asked() -> None:
        drain.wait()
        sched.drain()

    threading.Thread(target=drain_when_asked, daemon=True).start()
    say(as_json, {"role": "scheduler", "instance": cfg.instance, "listen": sched.address},
         f"scheduler {cfg.instance} on {sched.address}")
    reason = sched.run(stop)
    say(as_json, {"role": "scheduler", "instance": cfg.instance, "exit": reason}, f"scheduler {cfg.instance}: {reason}")


def run_engine(settings: NodeSettings, device: str | None = None, launch: dict[str, Any] | None = None,
               insecure: bool = False, as_json: bool = False) -> None:
    """Hold `settings`' layers behind a torch engine, or (engine "vllm") a whole vLLM instance's head, built with
    `launch` (VllmLaunch fields), until the scheduler or a signal stops the node."""
    from coral_dagster.runtime.engine import make_engine
    from coral_dagster.runtime.node import EngineNode

    _setup_logging()
    s = settings
    node_of: Callable[..., EngineNode[Any]]
    if s.engine == "vllm":
        from coral_dagster.runtime.vllm_engine import head_engine
        from coral_dagster.runtime.vllm_node import VllmNode

        node_of = partial(VllmNode, s, head_engine(s.model, s.split, **(launch or {})))
    else:
        node_of = partial(EngineNode, s, make_engine(s.engine, s.model, s.start, s.end, device=device))
    stop = threading.Event()
    stop_on_signals(stop)
    n = node_of(keys=CurveKeys.from_env(), insecure=insecure, credential=credentials.from_env(Env.NODE_CREDENTIAL))
    say(as_json, {"role": "engine", "node": s.node, "data": n.address},
         f"engine {s.node} layers {s.start}:{s.end} on {n.address}")
    reason = n.run(stop)
    say(as_json, {"role": "engine", "node": s.node, "exit": reason}, f"engine {s.node}: {reason}")
    if n.rejected:
        raise CoralError(f"node {s.node} was rejected: {n.rejected}.",
                         "start it with the model and layer range its instance expects")


def run_headless(model: str, split: tuple[int, ...], node_rank: int, launch: dict[str, Any]) -> None:
    """Run `vllm serve … --headless` for pipeline rank `node_rank` in this process, until vLLM exits."""
    from coral_dagster.runtime.vllm_engine import VllmLaunch, run_serve_line, vllm_model

    path, n_layers, _, dtype = vllm_model(model)
    spec = VllmLaunch(path, split or (n_layers,), dtype=dtype, **launch)
    argv = spec.argv(node_rank)
    os.environ.update(spec.env())
    print(" ".join(argv), file=sys.stderr, flush=True)
    try:
        run_serve_line(argv)
    except ImportError:
        raise CoralError("vLLM is not installed on this node.", "run sky_tasks/setup_node.sh first") from None
