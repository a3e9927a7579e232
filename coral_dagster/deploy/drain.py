"""The real drainer: asks the coordinator over ZeroMQ to drain an instance, then waits until the instance leaves;
and hands a live coordinator a new plan's admission limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from coral_dagster.errors import CoralError

if TYPE_CHECKING:
    from coral_dagster.runtime.client import Client


@dataclass
class CoordinatorDrainer:
    """Drains through the runtime's coordinator client, with the deployment's CURVE keys and registration key (which
    the coordinator asks a drain or admit command to prove) from the environment.

    The coordinator stops routing to the instance and tells its scheduler, which finishes the requests in flight
    (or gives up after its own drain timeout) and leaves; the instance then disappears from the coordinator's
    status. An instance the coordinator does not know (never registered, or already gone) has nothing in flight.
    """

    poll_s: float = 2.0
    insecure: bool = False
    environ: Mapping[str, str] | None = field(default=None, repr=False)

    def _client(self, coordinator: str) -> Client:
        from coral_dagster.runtime import credentials
        from coral_dagster.runtime.client import Client
        from coral_dagster.runtime.protocol import Env
        from coral_dagster.runtime.security import CurveKeys

        return Client(coordinator, keys=CurveKeys.from_env(self.environ), insecure=self.insecure,
                      registration_key=credentials.from_env(Env.REGISTRATION_KEY, self.environ))

    def drain(self, coordinator: str, instance_id: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._client(coordinator) as client:
            reply = client.drain(instance_id)
            if reply.get("kind") == "error":
                if reply.get("status") == 404:
                    return True
                raise CoralError(f"the coordinator at {coordinator} refused to drain {instance_id}: "
                                 f"{reply.get('problem')}", str(reply.get("fix", "")))
            while True:
                if instance_id not in {i["instance"] for i in client.status()["instances"]}:
                    return True
                if time.monotonic() >= deadline:
                    return False
                time.sleep(self.poll_s)

    def admit(self, coordinator: str, text: str) -> bool:
        with self._client(coordinator) as client:
            if client.status().get("admit", "") == text:
                return False
            reply = client.admit(text)
            if reply.get("kind") == "error":
                raise CoralError(f"the coordinator at {coordinator} refused the admission limits {text!r}: "
                                 f"{reply.get('problem')}", str(reply.get("fix", "")))
            return True
