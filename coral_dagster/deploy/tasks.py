"""SkyPilot task configs from the `sky_tasks/` YAMLs, filled per node; addresses, URLs and `sky down` lines."""

from __future__ import annotations

import copy
import shlex
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import yaml

from coral_dagster import paths
from coral_dagster.deploy.spec import (CORAL_PORT, GPU_ROLES, HEAD_ENGINE_PORT, HTTP_PORT, NIXL_SIDE_CHANNEL_PORT,
                                       VLLM_MASTER_PORT, NodeSpec)
from coral_dagster.errors import CatalogError, CoralError

SKY_TASKS_DIR = paths.REPO_ROOT / "sky_tasks"


@lru_cache(maxsize=None)
def _read_role_yaml(role: str) -> str:
    path = SKY_TASKS_DIR / f"{role}.yaml"
    if not path.is_file():
        raise CatalogError(path, "-", "-", "task YAML not found", "restore it from the repository")
    return path.read_text()


def role_template(role: str) -> dict[str, Any]:
    """The checked-in task of a role (`engine`, `vllm`, `coordinator`, `endpoint`), as a fresh dict; a role without
    secrets (the endpoint) may leave the section out."""
    doc = yaml.safe_load(_read_role_yaml(role))
    path = SKY_TASKS_DIR / f"{role}.yaml"
    doc.setdefault("secrets", {})
    for key in ("envs", "resources", "run"):
        if not doc.get(key):
            raise CatalogError(path, "-", key, "missing", f"give the task a {key} section")
    if not isinstance(doc["resources"].get("disk_size"), int):
        raise CatalogError(path, "-", "resources.disk_size", "missing or not a whole number of GB",
                           "state the disk of every cluster, e.g. disk_size: 256")
    if any(v is not None for v in doc["secrets"].values()):
        raise CatalogError(path, "-", "secrets", "a secret has a value written in the file",
                           "leave every secret null; SkyPilot takes the value at launch")
    return doc


def secret_names(role: str) -> tuple[str, ...]:
    """The secrets a role's task declares (values come from the launching machine's environment)."""
    return tuple(sorted(role_template(role)["secrets"]))


def disk_gb(role: str) -> int:
    """The disk every cluster of a role gets (`resources.disk_size` of its task)."""
    return role_template(role)["resources"]["disk_size"]


def wiring(node: NodeSpec, coordinators: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Env name -> clusters whose addresses fill it: the node's own wires (its instance's head, or a standby's
    primary), and every coordinator of the pair for the node that runs the instance's scheduler."""
    wires = dict(node.wires)
    if coordinators and node.runs_scheduler:
        wires["CORAL_COORDINATOR"] = coordinators
    return wires


def ports(node: NodeSpec) -> int | list[int]:
    """The ports a node's cluster opens: Coral's, plus vLLM's master port (vLLM nodes) and NixlConnector's
    handshake port (its PD instances' nodes), the engine's own beside the scheduler's (a Coral-runtime head), the
    HTTP front door (the coordinator, which the endpoint calls), or only the URL clients call (the endpoint)."""
    if node.role == "coordinator":
        return [CORAL_PORT, HTTP_PORT]
    if node.role == "endpoint":
        return [HTTP_PORT]
    if node.role == "vllm":
        nixl = [NIXL_SIDE_CHANNEL_PORT] if "VLLM_NIXL_SIDE_CHANNEL_PORT" in node.env() else []
        return [CORAL_PORT, VLLM_MASTER_PORT, *nixl]
    if node.role == "engine" and node.runs_scheduler:
        return [CORAL_PORT, HEAD_ENGINE_PORT]
    return CORAL_PORT


def wired_envs(node: NodeSpec, coordinators: tuple[str, ...], addresses: Mapping[str, str]) -> dict[str, str]:
    """The wiring envs as comma-separated `tcp://ip:port` lists; a cluster without a known address is an error."""
    out = {}
    for env, clusters in sorted(wiring(node, coordinators).items()):
        missing = [c for c in clusters if c not in addresses]
        if missing:
            raise CoralError(f"{node.cluster_name} needs the address of {missing[0]}, which has none recorded.",
                             "run `coral launch` again: it launches nodes in the order that fills this.")
        out[env] = ",".join(addresses[c] for c in clusters)
    return out


def task_config(node: NodeSpec, wired: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The role's task with this node's name, resources and envs; secrets stay names without values.

    `wired` holds the address envs (`wired_envs`); any the role declares but `wired` lacks stay "".
    """
    cfg = copy.deepcopy(role_template(node.role))
    cfg["name"] = node.cluster_name
    resources = dict(cfg["resources"])
    resources.update(cloud=node.cloud, region=node.cloud_region, ports=ports(node))
    if node.role in GPU_ROLES:
        resources.update(accelerators=node.node, instance_type=node.instance_type, use_spot=node.use_spot)
    cfg["resources"] = resources
    envs = {**cfg["envs"], **node.env(), **(wired or {})}
    cfg["envs"] = {k: str(v) for k, v in envs.items()}
    # An absolute workdir lets `sky launch` run the written YAML from any folder.
    cfg["workdir"] = str(paths.REPO_ROOT)
    return cfg


class _Dumper(yaml.SafeDumper):
    """Writes multi-line strings (setup, run) as literal blocks, as a person would."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s,
                                                             style="|" if "\n" in s else None))


def write_task(cfg: dict[str, Any], out_dir: Path, fix: str = "write to another folder") -> Path:
    """Write one task YAML named after its cluster into the folder `out_dir` (as `coral_dagster.files` writes:
    mode 0644, no symbolic link followed; `fix` says how to write elsewhere); returns its path."""
    from coral_dagster.files import write_file

    return write_file(out_dir / f"{cfg['name']}.yaml",
                      yaml.dump(cfg, Dumper=_Dumper, sort_keys=False, default_flow_style=False), fix=fix)


def node_address(ip: str) -> str:
    """The `tcp://ip:port` every Coral process listens on."""
    return f"tcp://{ip}:{CORAL_PORT}"


# A launched coordinator serves HTTPS (its own certificate, or one generated on its VM) unless launched with
# CORAL_PLAIN_HTTP=1 (`coral launch --plain-http`); docs/security.md, "No single coordinator".
HTTPS_SCHEME, PLAIN_SCHEME = "https", "http"


def scheme(plain_http: bool) -> str:
    return PLAIN_SCHEME if plain_http else HTTPS_SCHEME


def endpoint_ip(address: str) -> str:
    """The IP of a `tcp://ip:port` address."""
    return address.removeprefix("tcp://").rsplit(":", 1)[0]


def http_url(address: str, url_scheme: str = HTTPS_SCHEME) -> str:
    """The OpenAI base URL of a coordinator recorded at `tcp://ip:port`."""
    return f"{url_scheme}://{endpoint_ip(address)}:{HTTP_PORT}/v1"


def down_command(cluster_name: str) -> str:
    return f"sky down -y {shlex.quote(cluster_name)}"
