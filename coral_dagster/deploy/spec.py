"""A plan as nodes to run: a cluster per GPU node (an instance's first also runs its scheduler), a coordinator pair
and the endpoint in front of it."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Literal

import pandas as pd

from coral_dagster.allocation.types import Plan, PlannedInstance
from coral_dagster.catalog.nodes import NodeConfig
from coral_dagster.deploy import names
from coral_dagster.errors import CoralError
from coral_dagster.routing import admission_shares, instance_weight
from coral_dagster.runtime.protocol import Env
from coral_dagster.templates.engines import KV_ROLES, engine_connector, vllm_kv_transfer_config, vllm_violations
from coral_dagster.templates.types import Template

Role = Literal["coordinator", "endpoint", "engine", "vllm"]
# Roles whose clusters carry GPUs (planned and priced); the coordinators and the endpoint are CPU VMs.
GPU_ROLES: tuple[Role, ...] = ("engine", "vllm")
CPU_ROLES: tuple[Role, ...] = ("coordinator", "endpoint")
COORDINATOR_SLOT = "coordinator"
# The coordinator pair's slots: the primary serves, the standby (told the primary's address) takes over when the
# primary stops answering its health probe; every scheduler is given both addresses. The endpoint (HAProxy, told
# both) is the one URL clients call.
PRIMARY_SLOT = "primary"
STANDBY_SLOT = "standby"
ENDPOINT_SLOT = "endpoint"
# One port for every Coral process; SkyPilot opens it on each cluster so stages can reach each other.
CORAL_PORT = 5555
# The coordinator's OpenAI-compatible HTTP front door, opened to clients (they send the deployment's API key).
HTTP_PORT = 8000
# vLLM's torch.distributed port on an instance's head node (its --master-port), opened beside CORAL_PORT.
VLLM_MASTER_PORT = 29501
# A Coral-runtime head's engine port (sky_tasks/engine.yaml): its scheduler holds CORAL_PORT, the address the
# other nodes are given, and its engine takes the next one.
HEAD_ENGINE_PORT = CORAL_PORT + 1
# NixlConnector's handshake port on each node of a PD vLLM instance (vLLM 0.32's default, `vllm/envs.py`
# VLLM_NIXL_SIDE_CHANNEL_PORT; the port is this plus the data-parallel index, and instances here have no DP).
NIXL_SIDE_CHANNEL_PORT = 5600


@dataclass(frozen=True)
class NodePrice:
    """What one node of a configuration costs in a region, and the instance type that carries it."""

    region: str
    node: NodeConfig
    instance_type: str
    usd_per_hour: float
    spot_usd_per_hour: float | None


@dataclass(frozen=True)
class InstanceShape:
    """A planned template in one region, priced per node; `fingerprint` names it across plans."""

    template: Template
    region: str
    use_spot: bool
    count: int
    prices: tuple[NodePrice, ...]
    route_weight: float = 0.0  # the routing policy's weight of one instance (`coral_dagster.routing`)
    # vLLM's KV-transfer connector a prefill or decode template hands KV over with (None: Coral's runtime, or an
    # aggregated template).
    kv_connector: str | None = None

    @property
    def fingerprint(self) -> str:
        """Hash of everything a running instance embodies: template, layer split, node order, region, spot."""
        stages = [[s.start, s.end, [str(n) for n in s.nodes], [round(x, 9) for x in s.shares]]
                  for s in self.template.stages]
        parts = [self.template.template_id, self.region, stages, self.use_spot]
        doc = json.dumps(parts + ([self.kv_connector] if self.kv_connector else []), sort_keys=True)
        return hashlib.sha1(doc.encode()).hexdigest()[:12]

    def price_of(self, node: NodeConfig) -> NodePrice:
        for p in self.prices:
            if p.node == node:
                return p
        raise CoralError(f"no price for {node} in {self.region}.", "rebuild the deployment from the plan.")


@dataclass(frozen=True)
class NodeSpec:
    """One SkyPilot cluster: its role, place, resources and the envs that wire it to its peers."""

    cluster_name: str
    role: Role
    slot: str
    instance_id: str
    plan_id: str
    region: str
    model: str = ""
    phase: str = ""
    template_id: str = ""
    replica: int = -1
    instance_index: int = -1
    stage: int = -1
    node_index: int = -1
    node: str = ""
    instance_type: str = ""
    use_spot: bool = False
    # $/h from the plan's price rows; None: the rows price no such node (a coordinator's CPU VM).
    usd_per_hour: float | None = None
    envs: tuple[tuple[str, str], ...] = ()
    # Env name -> clusters whose addresses fill it at launch (launched before this node).
    wires: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def cloud(self) -> str:
        return self.region.split(":", 1)[0]

    @property
    def cloud_region(self) -> str:
        return self.region.split(":", 1)[1]

    def env(self) -> dict[str, str]:
        return dict(self.envs)

    @property
    def runs_scheduler(self) -> bool:
        """An instance's head (stage 0, node 0) runs its scheduler beside its engine; no CPU VM of its own."""
        return self.role in GPU_ROLES and self.stage == 0 and self.node_index == 0


@dataclass(frozen=True)
class InstanceSpec:
    """One serving instance in launch order: its head first (stage 0, node 0, which also runs the scheduler;
    the other nodes are given its address), then the rest stage by stage. Engines register with the
    scheduler, which routes activations stage to stage."""

    instance_id: str
    slot: str
    shape: InstanceShape
    replica: int
    plan_id: str
    index: int
    nodes: tuple[NodeSpec, ...]


def _rate(price: NodePrice, use_spot: bool) -> float:
    if not use_spot:
        return price.usd_per_hour
    if price.spot_usd_per_hour is None:
        raise CoralError(f"{price.node} in {price.region} has no spot market in the price snapshot.",
                         "plan it on demand, or pick a region that sells it on spot.")
    return price.spot_usd_per_hour


def _price_index(prices: pd.DataFrame) -> dict[tuple[str, NodeConfig], NodePrice]:
    out = {}
    for r in prices.itertuples(index=False):
        spot = None if r.spot_usd_per_hour is None or math.isnan(r.spot_usd_per_hour) else float(r.spot_usd_per_hour)
        node = NodeConfig.parse(r.node)
        out[(r.region, node)] = NodePrice(r.region, node, r.instance_type, float(r.usd_per_hour), spot)
    return out


def instance_shapes(plan: Plan, prices: pd.DataFrame, engine: str = "coral") -> tuple[InstanceShape, ...]:
    """Each planned (template, region) with its node prices, in a stable order; instances of 0 are dropped. Under
    an `engine` with a KV-transfer connector (`vllm`) the prefill and decode templates vLLM can run hand their KV
    over through it."""
    index = _price_index(prices)
    connector = engine_connector(engine)
    shapes = []
    for inst in plan.instances:
        if inst.count <= 0:
            continue
        if ":" not in inst.region:
            raise CoralError(f"plan region {inst.region!r} is not cloud:region.",
                             "plans name regions like aws:us-east-2 or gcp:us-central1.")
        node_prices = []
        for node, _ in inst.template.nodes.counts:
            p = index.get((inst.region, node))
            if p is None:
                raise CoralError(f"{node} is not sold in {inst.region} in the bundled price snapshot.",
                                 "re-plan with `coral plan` on the current prices (`coral catalog prices`).")
            node_prices.append(p)
        use_spot = _use_spot(inst)
        for p in node_prices:
            _rate(p, use_spot)
        weight = instance_weight(inst.template.phase, inst.template.tokens_per_s, plan.demand_tokens_per_s,
                                 inst.template.model)
        pd_connector = connector if inst.template.phase in KV_ROLES and not vllm_violations(inst.template, connector) \
            else None
        shapes.append(InstanceShape(inst.template, inst.region, use_spot, inst.count, tuple(node_prices), weight,
                                    pd_connector))
    shapes.sort(key=lambda s: (s.template.model, s.template.phase, s.region, s.template.template_id, s.fingerprint))
    fps = [s.fingerprint for s in shapes]
    if len(set(fps)) != len(fps):
        raise CoralError("the plan lists one template in one region twice.",
                         "merge the duplicate rows of the plan into one count.")
    return tuple(shapes)


def _use_spot(inst: PlannedInstance) -> bool:
    """Plans are on demand unless the planner marked the instance `use_spot`."""
    return bool(getattr(inst, "use_spot", False))


def _scheduler_envs(shape: InstanceShape, instance_id: str) -> dict[str, str]:
    """What the instance's scheduler reads (its head node runs it), given to every node of the instance."""
    t = shape.template
    return {
        Env.INSTANCE: instance_id,
        Env.MODEL: t.model,
        Env.PHASE: t.phase,
        Env.SPLIT: t.pp_partition,
        Env.TOKENS_PER_S: f"{t.tokens_per_s:.6g}",
        Env.REGION: shape.region,
        Env.ROUTE_WEIGHT: f"{shape.route_weight:.9g}",
    }


def build_instance(shape: InstanceShape, replica: int, plan_id: str, index: int) -> InstanceSpec:
    """Name every node of one instance, price it, and give each its envs.

    A template vLLM can run (`templates/engines.py`) becomes one vLLM pipeline: a cluster per stage node, the
    head (rank 0) running the instance's scheduler and vLLM's serving engine, the others vLLM's headless workers
    wired to the head's address; a prefill or decode one (`shape.kv_connector`) also gets its `--kv-transfer-config`
    (`_kv_envs`). Any other template runs on Coral's runtime: one engine cluster per node
    (layers, stage, share, split), the head (stage 0, node 0) also running the scheduler the others are wired
    to. Either way an instance is exactly its GPU nodes.
    """
    t = shape.template
    instance_id = f"{names.plan_tag(plan_id)}-i{index}"
    slot = f"{shape.fingerprint}#{replica}"
    # NodeSpec's fields every node of the instance shares, passed by keyword.
    common: dict[str, Any] = dict(slot=slot, instance_id=instance_id, plan_id=plan_id, region=shape.region,
                                  model=t.model, phase=t.phase, template_id=t.template_id, replica=replica,
                                  instance_index=index, use_spot=shape.use_spot)
    if not vllm_violations(t, shape.kv_connector):
        return _vllm_instance(shape, replica, plan_id, index, instance_id, slot, common)
    stage_names = [[names.engine_name(plan_id, t.model, t.phase, index, s, k) for k in range(len(stage.nodes))]
                   for s, stage in enumerate(t.stages)]
    head = stage_names[0][0]
    engines = []
    for s, stage in enumerate(t.stages):
        for k, node in enumerate(stage.nodes):
            price = shape.price_of(node)
            is_head = stage_names[s][k] == head
            envs = {
                **_scheduler_envs(shape, instance_id),
                Env.NODE: stage_names[s][k],
                Env.HEAD: "1" if is_head else "0",
                Env.LAYERS: f"{stage.start}:{stage.end}",
                Env.STAGE_RANK: str(s),
                Env.SHARE: f"{stage.shares[k]:.6g}",
                Env.TP: str(node.count),
                Env.ENGINE: "torch",
                "VLLM_PP_LAYER_PARTITION": t.pp_partition,
            }
            engines.append(NodeSpec(cluster_name=stage_names[s][k], role="engine", stage=s, node_index=k,
                                    node=str(node), instance_type=price.instance_type,
                                    usd_per_hour=_rate(price, shape.use_spot), envs=_env_items(envs),
                                    wires=() if is_head else ((str(Env.SCHEDULER), (head,)),), **common))
    return InstanceSpec(instance_id, slot, shape, replica, plan_id, index, tuple(engines))


def _vllm_instance(shape: InstanceShape, replica: int, plan_id: str, index: int, instance_id: str, slot: str,
                   common: dict) -> InstanceSpec:
    """One vLLM pipeline: node rank = stage; every node gets the split, TP and (wired) the head's address."""
    t = shape.template
    cluster_names = [names.engine_name(plan_id, t.model, t.phase, index, s, 0) for s in range(len(t.stages))]
    nodes = []
    for rank, stage in enumerate(t.stages):
        node = stage.nodes[0]
        price = shape.price_of(node)
        envs = {
            **_scheduler_envs(shape, instance_id),
            Env.NODE: cluster_names[rank],
            Env.LAYERS: f"0:{t.stages[-1].end}",
            Env.TP: str(node.count),
            Env.NODE_RANK: str(rank),
            Env.VLLM_PORT: str(VLLM_MASTER_PORT),
            "VLLM_PP_LAYER_PARTITION": t.pp_partition,
            **_kv_envs(shape, instance_id),
        }
        nodes.append(NodeSpec(cluster_name=cluster_names[rank], role="vllm", stage=rank, node_index=0,
                              node=str(node), instance_type=price.instance_type,
                              usd_per_hour=_rate(price, shape.use_spot), envs=_env_items(envs),
                              wires=((str(Env.VLLM_HEAD), (cluster_names[0],)),) if rank else (), **common))
    return InstanceSpec(instance_id, slot, shape, replica, plan_id, index, tuple(nodes))


def _kv_envs(shape: InstanceShape, instance_id: str) -> dict[str, str]:
    """A PD vLLM instance's connector settings, the same on every node (vLLM builds the connector on each rank):
    its `--kv-transfer-config` (`CORAL_KV_TRANSFER_CONFIG`: role from the phase, the instance id as the engine id
    its peers know it by) and, for NixlConnector, the handshake port (the task sets the host to the node's IP)."""
    if shape.kv_connector is None:
        return {}
    config = vllm_kv_transfer_config(shape.template.phase, shape.kv_connector, engine_id=instance_id)
    envs: dict[str, str] = {Env.KV_TRANSFER_CONFIG: json.dumps(config, sort_keys=True, separators=(",", ":"))}
    if shape.kv_connector == "NixlConnector":
        envs["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(NIXL_SIDE_CHANNEL_PORT)
    return envs


def coordinator_region(shapes: tuple[InstanceShape, ...]) -> str:
    """The region holding most planned nodes (ties: first by name), so most traffic stays inside it."""
    nodes: dict[str, int] = {}
    for s in shapes:
        nodes[s.region] = nodes.get(s.region, 0) + s.count * s.template.nodes.size
    return min(nodes, key=lambda r: (-nodes[r], r))


def build_coordinators(plan_id: str, region: str, shapes: tuple[InstanceShape, ...] = (),
                       plan: Plan | None = None, plain_http: bool = False) -> tuple[NodeSpec, NodeSpec, NodeSpec]:
    """The deployment's coordinator pair (request router and drain point) and its endpoint, CPU VMs the price rows
    do not price: the primary, a warm standby wired to the primary's address (`CORAL_PRIMARY`) that serves once the
    primary fails its health probe, and the endpoint wired to both (`CORAL_COORDINATOR`, primary first), HAProxy
    sending requests to whichever serves. The pair lists the models of `shapes` before their instances register
    and admits the request rates, bucket depths and promised shares of `plan` (`CORAL_ADMIT`, read as `coral serve
    coordinator --admit`) where it serves less than the demand. All three serve HTTPS unless `plain_http`
    (`CORAL_PLAIN_HTTP=1`); the scheme is kept in `phase`, which they otherwise leave empty."""
    from coral_dagster.runtime.config import format_admit

    envs: dict[str, str] = {Env.MODEL: " ".join(sorted({s.template.model for s in shapes}))}
    if plan is not None and plan.admission.limits:
        adm = plan.admission
        envs[Env.ADMIT] = format_admit(adm.admit_req_s, adm.admit_depth_req, adm.admit_peak, admission_shares(plan))
    if plain_http:
        envs["CORAL_PLAIN_HTTP"] = "1"
    primary = names.coordinator_name(plan_id)
    standby = f"{primary}-b"
    common: dict[str, Any] = dict(role="coordinator", instance_id=COORDINATOR_SLOT, plan_id=plan_id, region=region,
                                  phase="http" if plain_http else "https", envs=_env_items(envs))
    front = dict(common, role="endpoint", envs=_env_items({"CORAL_PLAIN_HTTP": "1"} if plain_http else {}))
    return (NodeSpec(cluster_name=primary, slot=PRIMARY_SLOT, **common),
            NodeSpec(cluster_name=standby, slot=STANDBY_SLOT, wires=(("CORAL_PRIMARY", (primary,)),), **common),
            NodeSpec(cluster_name=names.endpoint_name(plan_id), slot=ENDPOINT_SLOT,
                     wires=(("CORAL_COORDINATOR", (primary, standby)),), **front))


def build_coordinator(plan_id: str, region: str, shapes: tuple[InstanceShape, ...] = (),
                      plan: Plan | None = None) -> NodeSpec:
    """The primary of `build_coordinators`."""
    return build_coordinators(plan_id, region, shapes, plan)[0]


def deployment_nodes(plan: Plan, plan_id: str, prices: pd.DataFrame, engine: str = "coral") -> tuple[NodeSpec, ...]:
    """Every cluster of the plan deployed from nothing, in launch order: the coordinator pair and its endpoint, then
    each instance."""
    shapes = instance_shapes(plan, prices, engine)
    if not shapes:
        return ()
    nodes = list(build_coordinators(plan_id, coordinator_region(shapes), shapes, plan))
    replicas = [(shape, r) for shape in shapes for r in range(shape.count)]
    for index, (shape, replica) in enumerate(replicas):
        nodes += build_instance(shape, replica, plan_id, index).nodes
    return tuple(nodes)


def _env_items(envs: dict) -> tuple[tuple[str, str], ...]:
    """Envs as sorted (name, value) pairs of plain strings (`Env` members written as their names)."""
    return tuple(sorted((str(k), v) for k, v in envs.items()))
