"""The real launcher: SkyPilot's Python API behind the `Launcher` interface (SkyPilot imported lazily)."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from coral_dagster.deploy.launcher import LaunchError, LaunchRequest, LaunchResult, resolve_secrets

log = logging.getLogger(__name__)


def to_sky_task(request: LaunchRequest, environ: Mapping[str, str] | None = None) -> Any:
    """A `sky.Task` from the request's config, with its secrets filled from the environment as SkyPilot secrets.

    The values go only into the in-memory task, which SkyPilot redacts in its logs and YAML dumps.
    """
    import sky

    secrets = resolve_secrets(request.secret_names, environ, task_envs=request.config.get("envs", {}))
    task = sky.Task.from_yaml_config(copy.deepcopy(dict(request.config)),
                                     secrets_overrides=sorted(secrets.items()))
    task.validate()
    return task


@dataclass
class SkyLauncher:
    """Launches each node as its own SkyPilot cluster and tears clusters down, through `sky.launch` / `sky.down`.

    `retry_until_up` keeps SkyPilot retrying when the region has no capacity; off by default so a node that
    cannot start fails fast and reconcile rolls its instance back.
    """

    retry_until_up: bool = False
    environ: Mapping[str, str] | None = field(default=None, repr=False)

    def launch(self, request: LaunchRequest) -> LaunchResult:
        import sky

        task = to_sky_task(request, self.environ)
        log.info("sky launch %s", request.cluster_name)
        try:
            _, handle = sky.stream_and_get(sky.launch(task, cluster_name=request.cluster_name,
                                                      retry_until_up=self.retry_until_up))
        except Exception as exc:  # SkyPilot raises many types; reconcile needs one
            raise LaunchError(f"sky launch of {request.cluster_name} failed: {type(exc).__name__}: {exc}",
                              "see `sky status` and the SkyPilot logs; check cloud credentials (`sky check`), "
                              "quota and capacity in that region.") from exc
        ip = getattr(handle, "head_ip", None)
        if not ip:
            raise LaunchError(f"sky launch of {request.cluster_name} returned no head IP.",
                              f"check `sky status {request.cluster_name}`.")
        return LaunchResult(request.cluster_name, ip)

    def down(self, cluster_name: str) -> None:
        import sky
        from sky import exceptions

        log.info("sky down %s", cluster_name)
        try:
            sky.stream_and_get(sky.down(cluster_name))
        except exceptions.ClusterDoesNotExist:
            log.info("cluster %s was already gone", cluster_name)
