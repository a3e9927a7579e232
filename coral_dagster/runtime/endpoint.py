"""The deployment's one public endpoint: HAProxy in front of the coordinator pair, the primary active and the standby
its `backup`, each health-checked on `/ping`, so clients keep one URL when the primary dies."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from coral_dagster.errors import CoralError
from coral_dagster.files import PRIVATE_MODE, write_file

# Health checks: one every CHECK_INTER_MS, down after CHECK_FALL misses (a refused connection marks a server down
# at once, `observe layer4`), up after CHECK_RISE answers.
CHECK_INTER_MS, CHECK_FALL, CHECK_RISE = 500, 2, 1
# A streamed completion may run this long; a request's headers must arrive within the coordinator's read limit.
STREAM_TIMEOUT_S, HEADER_TIMEOUT_S = 600, 10
HAPROXY = "haproxy"
INSTALL_FIX = "install HAProxy (Debian/Ubuntu: `apt-get install haproxy`), or serve without --endpoint"


@dataclass(frozen=True)
class Upstream:
    """A coordinator's front door as HAProxy reaches it: host, port, and whether it speaks TLS."""

    host: str
    port: int
    tls: bool

    @classmethod
    def parse(cls, url: str) -> Upstream:
        """`http(s)://host:port` (a path is ignored); anything else is a CoralError naming the URL."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise CoralError(f"upstream {url!r} is not an http(s)://host:port URL.",
                             "give each coordinator's front door as http(s)://host:port, primary first")
        return cls(parts.hostname, parts.port, parts.scheme == "https")

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def haproxy_config(upstreams: Sequence[Upstream], host: str, port: int, pem: Path | None = None) -> str:
    """HAProxy's configuration: listen on `host:port` (TLS with `pem`, certificate and key in one file), send every
    request to the first upstream while it answers its health check and to the next ones (backups, in order) once
    it does not. A request is retried on another server only when its connection failed, before anything was sent,
    so none is answered twice; `/ping` answers 200 or 503 (no instance ready) while a coordinator lives."""
    if not upstreams:
        raise CoralError("the endpoint was given no coordinator to send requests to.",
                         "give the primary coordinator's URL, then the standby's")
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    lines = [
        "global",
        "    log stdout format raw local0 info",
        "    maxconn 4096",
        "defaults",
        "    mode http",
        "    log global",
        "    option httplog",
        "    option forwardfor",
        "    option redispatch",
        "    retries 3",
        "    retry-on conn-failure",
        "    timeout connect 2s",
        f"    timeout http-request {HEADER_TIMEOUT_S}s",
        f"    timeout client {STREAM_TIMEOUT_S}s",
        f"    timeout server {STREAM_TIMEOUT_S}s",
        "frontend coral",
        f"    bind {bind}" + (f" ssl crt {pem}" if pem else ""),
        "    default_backend coordinators",
        "backend coordinators",
        "    option httpchk GET /ping",
        "    http-check expect rstatus ^(200|503)$",
    ]
    for k, up in enumerate(upstreams):
        lines.append(f"    server {'primary' if k == 0 else f'standby{k}'} {up.address} check inter {CHECK_INTER_MS} "
                     f"fall {CHECK_FALL} rise {CHECK_RISE} observe layer4 error-limit 1 on-error mark-down"
                     + (" ssl verify none" if up.tls else "") + (" backup" if k else ""))
    return "\n".join(lines) + "\n"


def run_endpoint(upstreams: Sequence[str], host: str, port: int, config_dir: Path, pem: Path | None = None) -> None:
    """Write the configuration into `config_dir` and become HAProxy in the foreground (it logs to stdout)."""
    binary = shutil.which(HAPROXY)
    if binary is None:
        raise CoralError("HAProxy is not installed here.", INSTALL_FIX)
    text = haproxy_config([Upstream.parse(u) for u in upstreams], host, port, pem)
    cfg = write_file(Path(config_dir) / "haproxy.cfg", text, PRIVATE_MODE, fix="pass another folder")
    os.execv(binary, [binary, "-f", str(cfg), "-db"])
