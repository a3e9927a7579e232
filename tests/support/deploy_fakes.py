"""Recording fakes of the launcher and drainer interfaces (`coral_dagster.deploy.launcher`): the far side of the
cloud and coordinator boundaries, for the deployment tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from coral_dagster.deploy.launcher import LaunchError, LaunchRequest, LaunchResult


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
    """A drainer that records ("drain", instance) per request; instances in `slow` report requests in flight. It
    keeps each coordinator's admission limits as a coordinator does, recording every `admit`."""

    slow: set[str] = field(default_factory=set)
    calls: list[tuple[str, str]] = field(default_factory=list)
    coordinators: list[str] = field(default_factory=list)
    admits: list[tuple[str, str]] = field(default_factory=list)
    limits: dict[str, str] = field(default_factory=dict)

    def drain(self, coordinator: str, instance_id: str, timeout_s: float) -> bool:
        self.calls.append(("drain", instance_id))
        self.coordinators.append(coordinator)
        return instance_id not in self.slow

    def admit(self, coordinator: str, text: str) -> bool:
        self.admits.append((coordinator, text))
        changed, self.limits[coordinator] = self.limits.get(coordinator, "") != text, text
        if changed:
            self.calls.append(("admit", text))
        return changed
