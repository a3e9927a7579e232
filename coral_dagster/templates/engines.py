"""Which serving templates each engine can execute: Coral's own runtime runs every template, vLLM a subset.

vLLM (multiprocessing executor over separately started nodes, `vllm serve … --nnodes N --node-rank i
--master-addr HEAD`, no Ray) runs a template when:

- V1 one node per stage: vLLM has no data parallelism inside a pipeline stage, so a stage served by several
  nodes that split its load has no vLLM equivalent;
- V2 every node has the same GPU count: vLLM takes one tensor-parallel size for all stages, and its
  multiprocessing executor starts the same number of ranks (= TP) on every node; GPU types may differ;
- V3 the phase is `aggregated`, unless the engine hands the KV cache from prefill to decode instances through
  one of vLLM's KV-transfer connectors: engine `vllm` does (`PD_CONNECTOR`), engine `vllm-aggregated` does not.
  With a connector a prefill instance runs with `kv_role` `kv_producer` and a decode one with `kv_consumer`
  (`vllm_kv_transfer_config`), and the coordinator sends a request to a prefill instance for its first token
  (NixlConnector: `kv_transfer_params: {"do_remote_decode": true}`), then to a decode instance with the
  `kv_transfer_params` the prefill answered with (`do_remote_prefill`, `remote_engine_id`, `remote_host`,
  `remote_port`, `remote_block_ids`: vLLM 0.32's `nixl/base_scheduler.py`).
- V4 a decode template handing KV over through NixlConnector has one stage: vLLM 0.32's NIXL worker refuses a
  `kv_consumer` with pipeline_parallel_size > 1 (`nixl/base_worker.py`, "consumer (decode) does not support
  pipeline_parallel_size > 1"; its producers may be pipelined).

Ray would lift V2 (one rank per GPU, placed freely) but not V1, and needs a Ray cluster spanning the
instance's nodes; the multiprocessing executor is what vLLM documents for multi-node serving without it.

KV-transfer connectors of vLLM 0.32 (`vllm/distributed/kv_transfer/kv_connector/factory.py`, whose registry also
lists offloading and benchmark connectors that move no KV between instances) that move a prefill's KV cache to a
decode instance are `VLLM_PD_CONNECTORS`. `NixlConnector` is the one vLLM's disaggregated-prefill guide uses; it
runs on CUDA and (with host buffers, `kv_buffer_device: cpu`) on the CPU build (`nixl/utils.py:
_NIXL_SUPPORTED_DEVICE`), but needs the `nixl` package (UCX), which the CPU build does not install.
`ExampleConnector` (vLLM's reference connector: the producer writes each prompt's KV cache as safetensors files under
`shared_storage_path`, the consumer reads them) needs nothing beyond torch, so it is the one that runs on the CPU
build out of the box, for instances sharing a file system (one machine in a test); it is not for production.
"""

from __future__ import annotations

import json
from typing import Sequence

from coral_dagster.errors import CoralError
from coral_dagster.templates.types import Template
from coral_dagster.vocab import SERVING_ENGINES, ServingEngine
#: The connector engine `vllm` hands KV caches over with (vLLM's disaggregated-prefill guide's).
PD_CONNECTOR = "NixlConnector"
#: vLLM 0.32's connectors that move KV caches between a prefill and a decode instance, and where they run.
VLLM_PD_CONNECTORS: dict[str, str] = {
    "NixlConnector": "NIXL (UCX/RDMA); CUDA, XPU, TPU, CPU host buffers; needs the nixl package",
    "MooncakeConnector": "Mooncake transfer engine (RDMA); needs the mooncake package",
    "MoRIIOConnector": "AMD MoRI-IO; ROCm",
    "LMCacheConnectorV1": "LMCache (its own P2P or storage backends); needs the lmcache package",
    "ExampleConnector": "reference: KV as files under shared_storage_path; any device, one shared file system",
}
#: Connectors whose decode (consumer) instances must be one pipeline stage (V4).
ONE_STAGE_CONSUMERS = frozenset({"NixlConnector"})
#: `kv_role` of each phase's instances (vLLM 0.32 deprecates `kv_both` for NixlConnector).
KV_ROLES: dict[str, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}


def vllm_violations(t: Template, kv_connector: str | None = None) -> tuple[str, ...]:
    """The rules (V1–V4 above) that keep vLLM from running template `t`; empty when it can. With `kv_connector`
    (one of `VLLM_PD_CONNECTORS`), prefill and decode templates pass V3."""
    out = []
    crowded = [s for s, stage in enumerate(t.stages) if len(stage.nodes) != 1]
    if crowded:
        out.append(f"V1: stages {crowded} are served by several nodes (vLLM has no data parallelism in a stage)")
    counts = sorted({n.count for stage in t.stages for n in stage.nodes})
    if len(counts) > 1:
        out.append(f"V2: nodes hold {counts} GPUs (vLLM takes one tensor-parallel size for every stage)")
    if t.phase != "aggregated" and (kv_connector is None or t.phase not in KV_ROLES):
        out.append(f"V3: phase {t.phase} needs a KV handoff between instances (engine vllm runs aggregated "
                   "instances without a KV connector)")
    if t.phase == "decode" and kv_connector in ONE_STAGE_CONSUMERS and len(t.stages) > 1:
        out.append(f"V4: {kv_connector} decode instances are one pipeline stage in vLLM (this one has "
                   f"{len(t.stages)})")
    return tuple(out)


def check_engine(engine: str) -> ServingEngine:
    """`engine` as a known serving engine, or an error listing them."""
    if engine not in SERVING_ENGINES:
        raise CoralError(f"unknown serving engine {engine!r}.", f"use one of: {', '.join(SERVING_ENGINES)}")
    return engine  # type: ignore[return-value]


def engine_connector(engine: str) -> str | None:
    """The KV-transfer connector `engine` hands prefill KV caches to decode instances with (None: no handoff)."""
    return PD_CONNECTOR if check_engine(engine) == "vllm" else None


def runnable(engine: str, templates: Sequence[Template]) -> tuple[Template, ...]:
    """The templates `engine` can execute, in the given order."""
    if check_engine(engine) == "coral":
        return tuple(templates)
    connector = engine_connector(engine)
    return tuple(t for t in templates if not vllm_violations(t, connector))


def vllm_kv_transfer_config(phase: str, connector: str = PD_CONNECTOR, *, engine_id: str,
                            buffer_device: str | None = None, extra: dict | None = None) -> dict:
    """The `--kv-transfer-config` of a vLLM instance serving `phase` (prefill: the KV producer; decode: the
    consumer) of a PD pair through `connector`, as vLLM 0.32's `KVTransferConfig` takes it (`vllm/config/
    kv_transfer.py`: kv_connector, engine_id, kv_buffer_device, kv_role, kv_port, kv_connector_extra_config, …;
    unknown keys are refused). `engine_id` names the instance to its peers; `buffer_device` (None: the platform's
    device) is where the connector stages KV ('cpu' on the CPU build); `extra` goes to
    `kv_connector_extra_config` (e.g. ExampleConnector's `shared_storage_path`)."""
    if phase not in KV_ROLES:
        raise CoralError(f"no KV-transfer role for phase {phase!r}.",
                         f"use one of {', '.join(KV_ROLES)} (aggregated instances need no connector).")
    if connector not in VLLM_PD_CONNECTORS:
        raise CoralError(f"unknown vLLM PD connector {connector!r}.", f"use one of {', '.join(VLLM_PD_CONNECTORS)}.")
    if not engine_id:
        raise CoralError("a KV-transfer config without an engine_id.", "name the instance, e.g. its cluster name.")
    if buffer_device not in (None, "cuda", "cpu", "xpu"):
        raise CoralError(f"KV buffer device {buffer_device!r}.", "use cuda, cpu or xpu (vLLM 0.32's choices).")
    out: dict[str, object] = {"kv_connector": connector, "kv_role": KV_ROLES[phase], "engine_id": engine_id}
    if buffer_device is not None:
        out["kv_buffer_device"] = buffer_device
    if extra:
        out["kv_connector_extra_config"] = dict(extra)
    return out


def vllm_kv_transfer_arg(phase: str, connector: str = PD_CONNECTOR, **kw) -> list[str]:
    """`vllm serve` arguments for `vllm_kv_transfer_config`: `--kv-transfer-config` and its JSON."""
    return ["--kv-transfer-config", json.dumps(vllm_kv_transfer_config(phase, connector, **kw), sort_keys=True)]
