"""Instance credentials: an instance proves its name to the coordinator with a key derived from the deployment's
registration key, which only the coordinator and the launching machine hold (engine nodes hold the CURVE key too,
so CURVE alone cannot tell one instance from another)."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping

from coral_dagster.errors import CoralError
from coral_dagster.runtime.protocol import Env

MIN_KEY_CHARS = 32


def generate() -> str:
    """A fresh registration key for one deployment."""
    return secrets.token_urlsafe(32)


def _checked(key: str, name: str) -> str:
    key = key.strip()
    if len(key) < MIN_KEY_CHARS:
        raise CoralError(f"{name} holds {len(key)} characters; at least {MIN_KEY_CHARS} are needed.",
                         "generate one with `coral serve keys` and pass it unchanged")
    return key


def instance_credential(registration_key: str, instance: str) -> str:
    """The credential of instance `instance` (hex): only a holder of the registration key can derive it."""
    key = _checked(registration_key, Env.REGISTRATION_KEY.value)
    return hmac.new(key.encode(), f"coral-instance:{instance}".encode(), hashlib.sha256).hexdigest()


def proof(credential: str, nonce: str, instance: str, incarnation: str) -> str:
    """The answer to the coordinator's `nonce`: binds the credential to this registration of this process."""
    return hmac.new(credential.encode(), f"{nonce}:{instance}:{incarnation}".encode(), hashlib.sha256).hexdigest()


def verify(registration_key: str, nonce: str, instance: str, incarnation: str, answer: str) -> bool:
    """Whether `answer` proves instance `instance`'s credential for `nonce` (constant-time)."""
    expected = proof(instance_credential(registration_key, instance), nonce, instance, incarnation)
    return hmac.compare_digest(expected, answer)


def from_env(var: Env, env: Mapping[str, str] | None = None) -> str:
    """The registration key (coordinator) or instance credential (scheduler) from the environment; "" when unset."""
    value = (os.environ if env is None else env).get(var.value, "").strip()
    return _checked(value, var.value) if value else ""
