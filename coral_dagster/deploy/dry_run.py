"""`coral launch --dry-run` as SkyPilot users read a deployment: one task YAML per cluster kind, and `launch.sh`.

A cluster kind is one role on one kind of machine in one region (resources, ports, and the envs its clusters
share); `launch.sh` launches every cluster of the plan from its kind's YAML in launch order (`sky launch -c NAME
--env …`), keeps each address the later clusters are wired to in a shell variable (one `sky status --ip` per
wired cluster), and ends with the OpenAI URL clients call (the endpoint's, HTTPS unless `--plain-http`), which
sends requests to the primary coordinator and, once it stops answering, to its standby. SkyPilot's multi-task
YAMLs (`---`-separated tasks run as a pipeline by `sky jobs launch`) run each task after the previous one has
finished, which suits batch pipelines, not clusters that serve together and are wired by address; one YAML per
kind plus a script keeps each file one ordinary `sky launch` task.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from coral_dagster.deploy import tasks
from coral_dagster.deploy.spec import COORDINATOR_SLOT, CPU_ROLES, GPU_ROLES, NodeSpec
from coral_dagster.files import SCRIPT_MODE, make_dir, write_file
from coral_dagster.runtime.protocol import Env

if TYPE_CHECKING:
    from coral_dagster.deploy.reconcile import Diff

# How a dry run writes elsewhere, for messages about a folder it cannot write.
OUT_FIX = "pass another folder as --out"
# Envs that name one cluster: always given per cluster on `sky launch`, never in a kind's YAML.
IDENTITY_ENVS = ("CORAL_NODE", "CORAL_INSTANCE")


@dataclass(frozen=True)
class ClusterLaunch:
    """One `sky launch` of the script: the cluster, its kind's YAML, the envs given on the command line (literal
    values), and the envs filled from earlier clusters' addresses (env -> clusters)."""

    cluster: str
    kind: Path
    envs: tuple[tuple[str, str], ...]
    wired: tuple[tuple[str, tuple[str, ...]], ...]


@dataclass(frozen=True)
class DryRun:
    """The kind YAMLs and `launch.sh` a dry run wrote; `launches` in order; `commands` what the script runs;
    `endpoint` the OpenAI URL clients call (the endpoint in front of the pair) and `coordinators` the pair's, primary
    first, where the endpoint sends requests (`<IP of CLUSTER>` where the cluster is not up yet; None and () without
    a coordinator)."""

    yaml_paths: tuple[Path, ...]
    script: Path
    launches: tuple[ClusterLaunch, ...]
    commands: tuple[str, ...]
    endpoint: str | None = None
    coordinators: tuple[str, ...] = ()


def kind_name(node: NodeSpec) -> str:
    """`role[-head][-phase]-cloud-region[-node][-spot]`, as a file-name slug: an instance head differs from the
    nodes wired to it (it also runs the scheduler and opens the engine's port), and a vLLM PD instance's node
    (`vllm-prefill`, `vllm-decode`: connector envs, its handshake port) from an aggregated one."""
    pd = node.role == "vllm" and "CORAL_KV_TRANSFER_CONFIG" in node.env()
    parts = [node.role, "head" if node.role == "engine" and node.runs_scheduler else "", node.phase if pd else "",
             node.cloud, node.cloud_region, node.node, "spot" if node.use_spot else ""]
    return re.sub(r"[^a-z0-9]+", "-", "-".join(p for p in parts if p).lower()).strip("-")


def _variable(cluster: str) -> str:
    return "ADDR_" + re.sub(r"[^A-Za-z0-9]", "_", cluster).upper()


def _credential_lines(secrets: tuple[str, ...], envs: dict[str, str]) -> list[str]:
    """Shell lines deriving a node's credentials from CORAL_REGISTRATION_KEY, which stays on this machine, as
    `coral launch` does (`launcher.resolve_secrets`): the instance's for the node running its scheduler, its slot's
    for a node joining one, empty otherwise. (An assignment, then `export`: `set -e` stops the script when the
    derivation fails.)"""
    from coral_dagster.deploy.launcher import joins_scheduler, runs_scheduler

    instance = shlex.quote(envs.get(Env.INSTANCE, ""))
    lines = []
    if Env.INSTANCE_CREDENTIAL in secrets:
        value = f"$(coral serve keys --credential {instance})" if runs_scheduler(envs) else ""
        lines.append(f"{Env.INSTANCE_CREDENTIAL}={value}; export {Env.INSTANCE_CREDENTIAL}")
    if Env.NODE_CREDENTIAL in secrets:
        value = (f"$(coral serve keys --credential {instance} --node {shlex.quote(envs.get(Env.NODE, ''))} "
                 f"--stage {int(envs.get(Env.STAGE_RANK, 0))})" if joins_scheduler(envs) else "")
        lines.append(f"{Env.NODE_CREDENTIAL}={value}; export {Env.NODE_CREDENTIAL}")
    return lines


def write_dry_run(diff: Diff, out_dir: Path) -> DryRun:
    """Write the kind YAMLs (mode 0644) and `launch.sh` (0755) for what `diff` launches (in order) and removes;
    addresses of clusters already up are written in. Files are written as `coral_dagster.files` writes: a symbolic
    link already in `out_dir` is refused, never written through."""
    nodes, coordinator, addresses = diff.nodes_to_launch(), diff.coordinator_cluster, diff.addresses
    url_scheme = tasks.scheme(diff.plain_http)
    live_coordinator = diff.coordinator is not None and coordinator in addresses
    admission = dict(diff.coordinator.envs).get("CORAL_ADMIT", "") if diff.coordinator and live_coordinator else None
    make_dir(out_dir, OUT_FIX)
    configs = {n.cluster_name: tasks.task_config(n) for n in nodes}
    kinds: dict[str, list[NodeSpec]] = {}
    for n in nodes:
        kinds.setdefault(kind_name(n), []).append(n)
    paths, per_cluster = {}, {}
    for kind, members in kinds.items():
        envs = [configs[n.cluster_name]["envs"] for n in members]
        shared = {k: v for k, v in envs[0].items()
                  if k not in IDENTITY_ENVS and all(e.get(k) == v for e in envs[1:])}
        cfg = {**configs[members[0].cluster_name], "name": kind, "envs": shared}
        paths[kind] = tasks.write_task(cfg, out_dir, OUT_FIX)
        for n, e in zip(members, envs):
            per_cluster[n.cluster_name] = {k: v for k, v in e.items() if k not in shared}
    launches: list[ClusterLaunch] = []
    wired_to: set[str] = set()
    for n in nodes:
        wires = tasks.wiring(n, diff.coordinator_clusters)
        literal = {k: v for k, v in per_cluster[n.cluster_name].items() if k not in wires}
        known = {env: ",".join(addresses[c] for c in cs) for env, cs in wires.items()
                 if all(c in addresses for c in cs)}
        later = tuple(sorted((env, cs) for env, cs in wires.items() if env not in known))
        wired_to.update(c for _, cs in later for c in cs if c not in addresses)
        launches.append(ClusterLaunch(n.cluster_name, paths[kind_name(n)], tuple(sorted({**literal, **known}.items())),
                                      later))
    commands = []
    for n, launch in zip(nodes, launches):
        secrets = tasks.secret_names(n.role)
        commands += _credential_lines(secrets, n.env())
        line = " ".join(shlex.quote(p) for p in ["sky", "launch", "-y", "-d", "-c", n.cluster_name,
                                                 *[a for s in secrets for a in ("--secret", s)]])
        for key, value in launch.envs:
            line += " --env " + shlex.quote(f"{key}={value}")
        for env, clusters in launch.wired:
            line += f' --env "{env}=' + ",".join(addresses.get(c) or f"${{{_variable(c)}}}" for c in clusters) + '"'
        commands.append(f"{line} {shlex.quote(launch.kind.name)}")
        if n.cluster_name in wired_to:
            commands.append(f"{_variable(n.cluster_name)}=$(address {shlex.quote(n.cluster_name)})")
    if admission is not None:
        commands.append(f"# then set the live coordinator's admission limits to {admission or 'none'} "
                        "(`coral launch` does this through its admin route)")
    for removal in diff.remove:
        if removal.instance_id != COORDINATOR_SLOT:
            commands.append(f"# drain {removal.instance_id} through the coordinator ({removal.reason}), then:")
        commands += [tasks.down_command(c) for c in removal.clusters]
    front = [n.cluster_name for n in diff.front]
    urls = {c: tasks.http_url(addresses[c], url_scheme) if c in addresses else
            f"{url_scheme}://<IP of {c}>:{tasks.HTTP_PORT}/v1" for c in front}
    if any(n.role in CPU_ROLES for n in nodes) and diff.endpoint is not None:
        shown = f"{url_scheme}://{_shell_ip(diff.endpoint.cluster_name, addresses, wired_to)}:{tasks.HTTP_PORT}/v1"
        commands.append(f'echo "OpenAI API: {shown} (api_key: \\$CORAL_API_KEY; it sends requests to the primary '
                        'coordinator and, once that stops answering, to its standby)"')
    script = out_dir / "launch.sh"
    n_gpu = sum(n.role in GPU_ROLES for n in nodes)
    head = [
        "#!/usr/bin/env bash",
        f"# Written by `coral launch --dry-run`: {len(nodes)} cluster(s) ({n_gpu} GPU node(s)) from "
        f"{len(paths)} kind YAML(s) in this folder,",
        "# launched in order: the coordinator pair and its endpoint, then each instance head first (a cluster starts",
        "# after those whose addresses it is given). Secrets are read from this shell by name: export them first.",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        f'address() {{ echo "tcp://$(sky status --ip "$1"):{tasks.CORAL_PORT}"; }}',
        'host() { local a="${1#tcp://}"; echo "${a%:*}"; }',
    ]
    write_file(script, "\n".join(head + commands) + "\n", SCRIPT_MODE, fix=OUT_FIX)
    return DryRun(tuple(paths.values()), script, tuple(launches), tuple(commands),
                  urls[diff.endpoint.cluster_name] if diff.endpoint is not None else None,
                  tuple(urls[c] for c in diff.coordinator_clusters))


def _shell_ip(cluster: str, addresses: Mapping[str, str], wired_to: set[str]) -> str:
    """A cluster's IP as launch.sh knows it: recorded, held in its address variable, or asked of SkyPilot."""
    if cluster in addresses:
        return tasks.endpoint_ip(addresses[cluster])
    if cluster in wired_to:
        return f'$(host "${{{_variable(cluster)}}}")'
    return f"$(sky status --ip {shlex.quote(cluster)})"
