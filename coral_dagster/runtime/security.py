"""ZeroMQ CURVE on every TCP socket, loopback included: one keypair per deployment, delivered as environment secrets."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from coral_dagster.errors import CoralError
from coral_dagster.runtime.protocol import Env
from coral_dagster.runtime.wire import MAX_CONTROL_BYTES

ENV_SECRET_KEY = Env.CURVE_SECRET_KEY.value
ENV_PUBLIC_KEYS = Env.CURVE_PUBLIC_KEYS.value


@dataclass(frozen=True)
class CurveKeys:
    """The deployment keypair (z85) and the client public keys servers admit (the deployment's own always)."""

    secret: bytes
    public: bytes
    allowed: frozenset[bytes]

    @classmethod
    def from_secret(cls, secret: bytes | str, extra_public: tuple[bytes, ...] = ()) -> CurveKeys:
        secret = secret.encode() if isinstance(secret, str) else secret
        try:
            public = zmq.curve_public(secret)
        except (ValueError, zmq.ZMQError) as exc:
            raise CoralError(f"{ENV_SECRET_KEY} is not a z85 CURVE secret key ({exc}).",
                             "generate one with `coral serve keys` and pass it unchanged") from None
        return cls(secret, public, frozenset({public, *extra_public}))

    @classmethod
    def generate(cls) -> CurveKeys:
        """A fresh keypair for one deployment."""
        return cls.from_secret(zmq.curve_keypair()[1])

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CurveKeys | None:
        """Keys from `CORAL_CURVE_SECRET_KEY` (+ comma-separated `CORAL_CURVE_PUBLIC_KEYS`), or None if unset."""
        env = os.environ if env is None else env
        secret = env.get(ENV_SECRET_KEY, "").strip()
        if not secret:
            return None
        extra = tuple(k.strip().encode() for k in env.get(ENV_PUBLIC_KEYS, "").split(",") if k.strip())
        return cls.from_secret(secret, extra)

    def env(self) -> dict[str, str]:
        """The variables every process of the deployment needs (ship them as SkyPilot secrets)."""
        return {ENV_SECRET_KEY: self.secret.decode(), ENV_PUBLIC_KEYS: self.public.decode()}


def write_secret(path: Path, text: str) -> None:
    """Write `text` (a key) to `path`, readable by this user only (0600, whatever mode a file there had); refuses
    a symbolic link (its target would be overwritten), anything but a regular file, and a file of another user.

    The text goes to a new file (O_EXCL, O_NOFOLLOW) that then replaces `path`; a rename replaces a link that
    appeared meanwhile, never its target.
    """
    from coral_dagster.files import PRIVATE_MODE, write_file

    write_file(path, text, PRIVATE_MODE, private=True, fix="pass another --log-dir")


def endpoint_host(endpoint: str) -> str:
    """The host of a `tcp://host:port` endpoint; an IPv6 address with or without brackets (`[::1]`, `::1`)."""
    rest = endpoint.split("://", 1)[-1]
    return (rest.rsplit(":", 1)[0] if ":" in rest else rest).strip("[]")


def tcp_endpoint(host: str, port: int | str) -> str:
    """`tcp://host:port`, an IPv6 host in brackets as ZeroMQ and URLs want it."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _zmq_tcp(sock: zmq.Socket, endpoint: str) -> str:
    """`endpoint` as ZeroMQ takes it: an IPv6 host bracketed, with IPv6 enabled on the socket."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host = endpoint_host(endpoint)
    if ":" not in host:
        return endpoint
    sock.ipv6 = True
    return tcp_endpoint(host, endpoint.rsplit(":", 1)[1])


def is_local(endpoint: str) -> bool:
    """True for inproc/ipc endpoints and TCP on a loopback address (IPv6 `::1` included)."""
    if endpoint.startswith(("inproc://", "ipc://")):
        return True
    host = endpoint_host(endpoint)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _AllowList:
    def __init__(self, allowed: frozenset[bytes]) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.allowed


class Security:
    """Binds and connects sockets of one context: CURVE on every TCP socket; without keys only inproc/ipc,
    unless `insecure` (plain TCP, for a trusted network)."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys | None, insecure: bool = False) -> None:
        self.ctx, self.keys, self.insecure = ctx, keys, insecure
        self._auth: ThreadAuthenticator | None = None
        self._pushes: dict[str, zmq.Socket] = {}

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def _check(self, endpoint: str, verb: str) -> None:
        if self.keys is not None or not endpoint.startswith("tcp://"):
            return
        if not self.insecure:
            raise CoralError(f"refusing to {verb} {endpoint} without CURVE: any process that reaches the port could "
                             "register as an instance, take over a peer's identity or read requests.",
                             f"set {ENV_SECRET_KEY} (from `coral serve keys`) on every process of the deployment, "
                             "or pass --insecure on a trusted network")

    def bind(self, sock: zmq.Socket, endpoint: str, max_bytes: int = MAX_CONTROL_BYTES, router: bool = False) -> str:
        """Bind as a CURVE server admitting only the deployment's keys, refusing frames over `max_bytes` before
        they are read; returns the bound endpoint.

        A `router` keeps each routing id with the connection that first used it (a newer connection cannot take a
        live peer's id over), says when a peer is gone (a send to it fails instead of vanishing), and drops a
        connection whose peer stops answering ZMTP pings (a host that died without closing its sockets).
        """
        self._check(endpoint, "listen on")
        if router:
            sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        if self.keys is not None and endpoint.startswith("tcp://"):
            if self._auth is None:
                self._auth = ThreadAuthenticator(self.ctx)
                self._auth.start()
                self._auth.configure_curve_callback("*", credentials_provider=_AllowList(self.keys.allowed))
            sock.curve_secretkey = self.keys.secret
            sock.curve_publickey = self.keys.public
            sock.curve_server = True
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        sock.bind(_zmq_tcp(sock, endpoint))
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def connect(self, sock: zmq.Socket, endpoint: str, server_key: bytes | None = None,
                max_bytes: int = MAX_CONTROL_BYTES) -> None:
        """Connect as a CURVE client that only talks to a server holding the deployment's secret."""
        self._check(endpoint, "connect to")
        if self.keys is not None and endpoint.startswith("tcp://"):
            sock.curve_secretkey = self.keys.secret
            sock.curve_publickey = self.keys.public
            sock.curve_serverkey = server_key or self.keys.public
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        sock.connect(_zmq_tcp(sock, endpoint))

    def push(self, endpoint: str) -> zmq.Socket:
        """The PUSH socket connected to `endpoint` (a stage's data socket), made on first use and kept until `close`."""
        sock = self._pushes.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.linger = 0
            sock.sndhwm = 256
            self.connect(sock, endpoint)
            self._pushes[endpoint] = sock
        return sock

    def close(self) -> None:
        """Close the PUSH sockets and stop the authenticator."""
        for sock in self._pushes.values():
            sock.close(linger=0)
        self._pushes.clear()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
