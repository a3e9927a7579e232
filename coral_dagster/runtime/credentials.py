"""Instance and node credentials: an instance proves its name to the coordinator with a key derived from the
deployment's registration key, which only the coordinator and the launching machine hold (engine nodes hold the CURVE
key too, so CURVE alone cannot tell one instance from another); an engine node proves its slot (instance, stage, node
name) to its instance's scheduler with a key derived from that instance's credential; the launching machine proves the
registration key itself to drain an instance or set admission limits. Every derivation is stateless (HMAC)."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping

from coral_dagster.errors import CoralError
from coral_dagster.runtime.protocol import Env, Kind

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


def node_credential(instance_credential: str, stage: int, node: str) -> str:
    """The credential of engine node `node` holding stage `stage` of the instance whose credential is
    `instance_credential` (hex): its scheduler derives it from its own credential, the launching machine from the
    registration key (`node_credential_of`), and no other node of the deployment can."""
    key = _checked(instance_credential, Env.INSTANCE_CREDENTIAL.value)
    return hmac.new(key.encode(), f"coral-node:{int(stage)}:{node}".encode(), hashlib.sha256).hexdigest()


def node_credential_of(registration_key: str, instance: str, stage: int, node: str) -> str:
    """`node_credential` from the registration key (the launching machine's, `coral serve keys --node`)."""
    return node_credential(instance_credential(registration_key, instance), stage, node)


def node_proof(credential: str, nonce: str, stage: int, node: str, incarnation: str) -> str:
    """An engine node's answer to its scheduler's `nonce`, bound to its slot and process."""
    return proof(credential, nonce, f"node:{int(stage)}:{node}", incarnation)


def verify_node(instance_credential: str, nonce: str, stage: int, node: str, incarnation: str, answer: str) -> bool:
    """Whether `answer` proves node `node`'s credential for stage `stage` of this instance (constant-time)."""
    expected = node_proof(node_credential(instance_credential, stage, node), nonce, stage, node, incarnation)
    return hmac.compare_digest(expected, answer)


def step_mac(route_key: str, rid: str, pos: int, stage: int) -> str:
    """What a step of request `rid` at `pos` for stage `stage` carries: only its instance's scheduler and welcomed
    nodes hold `route_key`, so a node takes activations from them alone."""
    return hmac.new(route_key.encode(), f"step:{rid}:{int(pos)}:{int(stage)}".encode(), hashlib.sha256).hexdigest()


def kv_mac(route_key: str, rid: str) -> str:
    """What a KV handoff of request `rid` into the instance holding `route_key` carries (its scheduler gives it to
    the prefill instance with the KV route)."""
    return hmac.new(route_key.encode(), f"kv:{rid}".encode(), hashlib.sha256).hexdigest()


def proof(key: str, nonce: str, subject: str, detail: str) -> str:
    """The answer to the coordinator's `nonce` with `key` (an instance credential, or the registration key), bound
    to what it is for: (instance, incarnation) for a registration, (command kind, its argument) for a command."""
    return hmac.new(key.encode(), f"{nonce}:{subject}:{detail}".encode(), hashlib.sha256).hexdigest()


def verify(registration_key: str, nonce: str, instance: str, incarnation: str, answer: str) -> bool:
    """Whether `answer` proves instance `instance`'s credential for `nonce` (constant-time)."""
    expected = proof(instance_credential(registration_key, instance), nonce, instance, incarnation)
    return hmac.compare_digest(expected, answer)


def command_proof(registration_key: str, nonce: str, command: Mapping[str, object]) -> str:
    """The proof of the registration key for a `drain` or `admit` command, bound to its kind and argument."""
    argument = command["instance"] if command["kind"] == Kind.DRAIN else command.get("admit", "")
    return proof(registration_key, nonce, str(command["kind"]), str(argument))


def verify_operator(registration_key: str, nonce: str, command: Mapping[str, object], answer: str) -> bool:
    """Whether `answer` proves the registration key itself for `command` (constant-time)."""
    return hmac.compare_digest(command_proof(registration_key, nonce, command), answer)


def from_env(var: Env, env: Mapping[str, str] | None = None) -> str:
    """The registration key (coordinator), instance credential (scheduler) or node credential (engine node) from the
    environment; "" when unset."""
    value = (os.environ if env is None else env).get(var.value, "").strip()
    return _checked(value, var.value) if value else ""
