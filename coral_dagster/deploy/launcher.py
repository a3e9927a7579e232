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


def resolve_secrets(names: tuple[str, ...], environ: Mapping[str, str] | None = None,
                    instance: str = "") -> dict[str, str]:
    """The value of each secret from the environment; every one must be set (empty is passed on as empty).

    `CORAL_INSTANCE_CREDENTIAL` is not read but derived for `instance` from `CORAL_REGISTRATION_KEY` (which itself
    stays on this machine unless the task names it)."""
    env = os.environ if environ is None else environ
    credential, registration = Env.INSTANCE_CREDENTIAL.value, Env.REGISTRATION_KEY.value
    read = [n for n in names if n != credential]
    needed = read + [registration] if credential in names and registration not in read else read
    missing = [n for n in needed if n not in env]
    if missing:
        raise CoralError(f"secret(s) {', '.join(missing)} are not set in this shell.",
                         f"export {missing[0]}=... (HF_TOKEN from huggingface.co/settings/tokens, empty for ungated "
                         "models; the CURVE variables and CORAL_REGISTRATION_KEY from `coral serve keys`).")
    out = {n: env[n] for n in read}
    if credential in names:
        if not instance:
            raise CoralError(f"{credential} is asked for a task without CORAL_INSTANCE.",
                             "name the instance in the task's envs (the deploy spec does)")
        out[credential] = credentials.instance_credential(env[registration], instance)
    return out
