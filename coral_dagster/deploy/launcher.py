"""The launcher and drainer interfaces reconcile talks to (SkyPilot and the coordinator behind them)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

from coral_dagster.errors import CoralError
from coral_dagster.runtime import credentials
from coral_dagster.runtime.protocol import Env


class LaunchError(CoralError):
    """A node could not be launched (no capacity, quota, credentials, setup failure)."""


@dataclass(frozen=True)
class LaunchRequest:
    """One cluster to launch: its task config (no secret values) and the secrets to take from the environment."""

    cluster_name: str
    config: Mapping[str, Any]
    secret_names: tuple[str, ...]


@dataclass(frozen=True)
class LaunchResult:
    cluster_name: str
    head_ip: str


class Launcher(Protocol):
    """Starts and stops clusters; `launch` raises on failure, `down` of an unknown cluster is not an error."""

    def launch(self, request: LaunchRequest) -> LaunchResult: ...

    def down(self, cluster_name: str) -> None: ...


class Drainer(Protocol):
    """Talks to the live coordinator: drains instances, and sets the plan's admission limits.

    `drain` asks it to stop routing to an instance and waits for its in-flight requests: True when the instance
    finished them within `timeout_s`, False when it did not. `admit` sets its admission limits to `text` (the
    plan's `CORAL_ADMIT`, empty to admit everything): True when they changed, False when they already held.
    """

    def drain(self, coordinator: str, instance_id: str, timeout_s: float) -> bool: ...

    def admit(self, coordinator: str, text: str) -> bool: ...


def runs_scheduler(task_envs: Mapping[str, str]) -> bool:
    """Whether a task runs its instance's scheduler: a Coral-runtime head, or a vLLM pipeline's rank 0."""
    if Env.NODE_RANK.value in task_envs:
        return str(task_envs[Env.NODE_RANK.value]) == "0"
    return str(task_envs.get(Env.HEAD.value, "0")) == "1"


def joins_scheduler(task_envs: Mapping[str, str]) -> bool:
    """Whether a task's node says hello to its instance's scheduler (every engine node; a vLLM pipeline's rank 0)."""
    return runs_scheduler(task_envs) or Env.NODE_RANK.value not in task_envs


def resolve_secrets(names: tuple[str, ...], environ: Mapping[str, str] | None = None,
                    task_envs: Mapping[str, str] | None = None) -> dict[str, str]:
    """The value of each secret from the environment; every one must be set (empty is passed on as empty).

    `CORAL_INSTANCE_CREDENTIAL` and `CORAL_NODE_CREDENTIAL` are not read but derived from `CORAL_REGISTRATION_KEY`
    (which itself stays on this machine unless the task names it) for the task's instance, stage and node
    (`task_envs`): the instance credential only for the node that runs its scheduler (empty elsewhere), the node
    credential for the node that joins the scheduler (empty for a vLLM worker rank)."""
    env = os.environ if environ is None else environ
    task_envs = task_envs or {}
    derived = {Env.INSTANCE_CREDENTIAL.value, Env.NODE_CREDENTIAL.value} & set(names)
    registration = Env.REGISTRATION_KEY.value
    read = [n for n in names if n not in derived]
    needed = read + [registration] if derived and registration not in read else read
    missing = [n for n in needed if n not in env]
    if missing:
        raise CoralError(f"secret(s) {', '.join(missing)} are not set in this shell.",
                         f"export {missing[0]}=... (HF_TOKEN from huggingface.co/settings/tokens, empty for ungated "
                         "models; the CURVE variables and CORAL_REGISTRATION_KEY from `coral serve keys`).")
    out = {n: env[n] for n in read}
    if not derived:
        return out
    instance = str(task_envs.get(Env.INSTANCE.value, ""))
    if not instance:
        raise CoralError(f"{', '.join(sorted(derived))} asked for a task without CORAL_INSTANCE.",
                         "name the instance in the task's envs (the deploy spec does)")
    head = runs_scheduler(task_envs)
    if Env.INSTANCE_CREDENTIAL.value in derived:
        out[Env.INSTANCE_CREDENTIAL.value] = (credentials.instance_credential(env[registration], instance)
                                              if head else "")
    if Env.NODE_CREDENTIAL.value in derived:
        joins = joins_scheduler(task_envs)
        stage = int(task_envs.get(Env.STAGE_RANK.value, 0))
        node = str(task_envs.get(Env.NODE.value, ""))
        out[Env.NODE_CREDENTIAL.value] = (credentials.node_credential_of(env[registration], instance, stage, node)
                                          if joins else "")
    return out
