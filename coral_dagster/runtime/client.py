"""A ZeroMQ client of the coordinator: submit prompts and read their events, drain instances, read status."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import zmq

from coral_dagster.errors import CoralError
from coral_dagster.runtime import credentials, wire
from coral_dagster.runtime.protocol import Env, Kind
from coral_dagster.runtime.sampling import SamplingParams
from coral_dagster.runtime.security import CurveKeys, Security

FINAL = ("done", "error")


class Client:
    """One DEALER socket; every event names the request's `tag`, so many requests share the socket."""

    def __init__(self, endpoint: str, keys: CurveKeys | None = None, ctx: zmq.Context | None = None,
                 timeout_s: float = 120.0, insecure: bool = False, registration_key: str = "") -> None:
        self.endpoint, self.timeout_s = endpoint, timeout_s
        # Answers a coordinator's challenge to `drain` and `admit` (the launching machine's key).
        self.registration_key = registration_key
        self.ctx = ctx or zmq.Context.instance()
        self.security = Security(self.ctx, keys, insecure)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.security.connect(self.sock, endpoint)
        self._tags = itertools.count()
        self._kept: list[dict[str, Any]] = []

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close(linger=0)
        self.security.close()

    def _tag(self) -> str:
        return f"t{next(self._tags)}"

    def next_event(self, tags: set[str] | None = None, timeout_s: float | None = None) -> dict[str, Any]:
        """The next event of a request in `tags` (any when None), keeping the others for later callers."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            for i, event in enumerate(self._kept):
                if tags is None or event.get("tag") in tags:
                    return self._kept.pop(i)
            left = deadline - time.monotonic()
            if left <= 0:
                raise CoralError(f"no reply from the coordinator at {self.endpoint} within {timeout_s:g} s.",
                                 "check that `coral serve coordinator` runs there and that this client has the "
                                 "deployment's CURVE key")
            if self.sock.poll(max(1, int(1000 * left))):
                self._kept.extend(h for _, h, _ in wire.drain(self.sock))

    def submit(self, model: str, prompt: str | None = None, prompt_tokens: list[int] | None = None,
               max_tokens: int = 16, ignore_eos: bool = False, sampling: SamplingParams | None = None) -> str:
        """Send one request (greedy unless `sampling`); returns its tag."""
        tag = self._tag()
        header = {"kind": Kind.SUBMIT, "tag": tag, "model": model, "max_tokens": max_tokens, "ignore_eos": ignore_eos,
                  "sampling": sampling.message() if sampling else None}
        header.update({"prompt_tokens": list(prompt_tokens)} if prompt_tokens is not None else {"prompt": prompt})
        wire.send(self.sock, header, block=True)
        return tag

    def cancel(self, rid: str) -> None:
        wire.send(self.sock, {"kind": Kind.CANCEL, "rid": rid}, block=True)

    def events(self, tags: list[str], timeout_s: float | None = None) -> Iterator[dict[str, Any]]:
        """Events of the requests `tags` as they arrive, until each has its `done` or `error`."""
        open_tags = set(tags)
        while open_tags:
            event = self.next_event(open_tags, timeout_s)
            if event["kind"] in FINAL:
                open_tags.discard(event["tag"])
            yield event

    def complete(self, model: str, prompts: list[str], max_tokens: int = 16, ignore_eos: bool = False,
                 timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Submit every prompt at once; the final event of each, in prompt order."""
        tags = [self.submit(model, p, max_tokens=max_tokens, ignore_eos=ignore_eos) for p in prompts]
        final = {e["tag"]: e for e in self.events(tags, timeout_s) if e["kind"] in FINAL}
        return [final[t] for t in tags]

    def call(self, header: dict[str, Any], timeout_s: float = 10.0) -> dict[str, Any]:
        """Send a command (`status`, `drain`, `admit`) and wait for its reply; a coordinator's challenge is answered
        once with a proof of the registration key."""
        tag = self._tag()
        wire.send(self.sock, {**header, "tag": tag}, block=True)
        reply = self.next_event({tag}, timeout_s)
        if reply["kind"] != Kind.CHALLENGE:
            return reply
        if not self.registration_key:
            raise CoralError(f"the coordinator at {self.endpoint} takes `{header['kind']}` only with a proof of "
                             f"the deployment's {Env.REGISTRATION_KEY.value}.",
                             f"export the {Env.REGISTRATION_KEY.value} that `coral serve keys` printed for it")
        answer = credentials.command_proof(self.registration_key, reply["nonce"], header)
        wire.send(self.sock, {**header, "tag": tag, "proof": answer}, block=True)
        return self.next_event({tag}, timeout_s)

    def status(self) -> dict[str, Any]:
        return self.call({"kind": Kind.STATUS})

    def drain(self, instance: str) -> dict[str, Any]:
        return self.call({"kind": Kind.DRAIN, "instance": instance})

    def admit(self, text: str) -> dict[str, Any]:
        """Set the coordinator's admission limits (`--admit` text; empty admits everything)."""
        return self.call({"kind": Kind.ADMIT, "admit": text})

    def wait_ready(self, n_instances: int, timeout_s: float) -> dict[str, Any]:
        """Poll status until `n_instances` instances are ready; raises with the last status when time runs out."""
        deadline = time.monotonic() + timeout_s
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                status = self.status()
            except CoralError:
                continue
            if sum(i["state"] == "ready" for i in status["instances"]) >= n_instances:
                return status
            time.sleep(0.1)
        states = {i["instance"]: i["state"] for i in status.get("instances", [])}
        raise CoralError(f"only {sum(s == 'ready' for s in states.values())} of {n_instances} instances became "
                         f"ready within {timeout_s:g} s (states: {states or 'none registered'}).",
                         "read the scheduler and engine logs; a node may have failed to start")
