"""The launcher and drainer interfaces reconcile talks to, with recording fakes for tests and dry runs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from coral_dagster.errors import CoralError


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
    """Asks the coordinator to stop routing to an instance and waits for its in-flight requests.

    Returns True when the instance finished its requests within `timeout_s`, False when it did not.
    """

    def drain(self, coordinator: str, instance_id: str, timeout_s: float) -> bool: ...


def resolve_secrets(names: tuple[str, ...], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The value of each secret from the environment; every one must be set (empty is passed on as empty)."""
    env = os.environ if environ is None else environ
    missing = [n for n in names if n not in env]
    if missing:
        raise CoralError(f"secret(s) {', '.join(missing)} are not set in this shell.",
                         f"export {missing[0]}=... (HF_TOKEN from huggingface.co/settings/tokens, empty for ungated "
                         "models; both CURVE variables from `coral serve keys`).")
    return {n: env[n] for n in names}


@dataclass
class RecordingLauncher:
    """A launcher that launches nothing: it records each call, hands out made-up IPs, and fails on request.

    `fail` names clusters whose launch raises `LaunchError`; `fail_down` clusters whose `down` raises. Pass one
    `calls` list to this and a `RecordingDrainer` to see both in one order.
    """

    fail: set[str] = field(default_factory=set)
    fail_down: set[str] = field(default_factory=set)
    calls: list[tuple[str, str]] = field(default_factory=list)
    requests: dict[str, LaunchRequest] = field(default_factory=dict)
    ips: dict[str, str] = field(default_factory=dict)

    def launch(self, request: LaunchRequest) -> LaunchResult:
        self.calls.append(("launch", request.cluster_name))
        self.requests[request.cluster_name] = request
        if request.cluster_name in self.fail:
            raise LaunchError(f"cluster {request.cluster_name} failed to launch (simulated).",
                              "nothing to fix: the recording launcher was told to fail it.")
        n = len(self.ips) + 1
        self.ips[request.cluster_name] = f"10.{n // 65536 % 256}.{n // 256 % 256}.{n % 256}"
        return LaunchResult(request.cluster_name, self.ips[request.cluster_name])

    def down(self, cluster_name: str) -> None:
        self.calls.append(("down", cluster_name))
        if cluster_name in self.fail_down:
            raise LaunchError(f"cluster {cluster_name} did not go down (simulated).", "retry later.")


@dataclass
class RecordingDrainer:
    """A drainer that records ("drain", instance) per request; instances in `slow` report requests in flight."""

    slow: set[str] = field(default_factory=set)
    calls: list[tuple[str, str]] = field(default_factory=list)
    coordinators: list[str] = field(default_factory=list)

    def drain(self, coordinator: str, instance_id: str, timeout_s: float) -> bool:
        self.calls.append(("drain", instance_id))
        self.coordinators.append(coordinator)
        return instance_id not in self.slow
