"""Multipart messages: one small JSON header frame, then raw tensor frames; nothing received is unpickled."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import zmq

from coral_dagster.errors import CoralError

log = logging.getLogger(__name__)

# Little-endian numeric types only; bfloat16 travels as its uint16 bits.
ALLOWED_DTYPES = frozenset({"|u1", "|i1", "<u2", "<i2", "<i4", "<i8", "<f2", "<f4", "<f8"})
MAX_HEADER_BYTES = 4 << 20
# ZeroMQ drops a larger frame before allocating it: control sockets carry JSON and token ids, data sockets
# carry activations and KV caches.
MAX_CONTROL_BYTES = 8 << 20
MAX_DATA_BYTES = 1 << 30
# K and V for every layer of the largest model, with room to spare.
MAX_FRAMES = 1024


class WireError(CoralError):
    """A message that does not follow the framing: dropped, never half-read."""


def pack(header: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> list[Any]:
    """Frames for `header` (JSON) and `arrays` (raw C-order bytes, described in the header)."""
    descs, bufs = [], []
    for a in arrays:
        a = np.ascontiguousarray(a)
        if a.dtype.str not in ALLOWED_DTYPES:
            raise WireError(f"dtype {a.dtype} cannot travel on the wire.",
                            f"convert to one of {sorted(ALLOWED_DTYPES)}")
        descs.append([a.dtype.str, list(a.shape)])
        bufs.append(a.reshape(-1).data.cast("B") if a.size else b"")
    return [json.dumps({**header, "tensors": descs}, separators=(",", ":")).encode(), *bufs]


def _buffer(frame: Any) -> memoryview | bytes:
    return frame.buffer if isinstance(frame, zmq.Frame) else frame


def unpack(frames: Sequence[Any]) -> tuple[dict[str, Any], list[np.ndarray]]:
    """(header, arrays) of a message, checked against its own description; arrays are read-only views."""
    if not frames:
        raise WireError("empty message.", "send a JSON header frame first")
    if len(frames) > MAX_FRAMES:
        raise WireError(f"message of {len(frames)} frames exceeds {MAX_FRAMES}.", "send fewer tensors per message")
    raw = bytes(_buffer(frames[0]))
    if len(raw) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}.", "send tensors as raw frames")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise WireError(f"header is not JSON ({exc!r}).", "send a flat JSON object as the first frame") from None
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise WireError("header lacks a string 'kind'.", "send {'kind': ..., ...}")
    descs = header.pop("tensors", [])
    if not isinstance(descs, list) or len(descs) != len(frames) - 1:
        raise WireError(f"header describes {len(descs) if isinstance(descs, list) else '?'} tensors but "
                        f"{len(frames) - 1} frames follow.", "describe every raw frame once")
    arrays = []
    for desc, frame in zip(descs, frames[1:]):
        if (not isinstance(desc, list) or len(desc) != 2 or desc[0] not in ALLOWED_DTYPES
                or not isinstance(desc[1], list) or not all(isinstance(d, int) and d >= 0 for d in desc[1])):
            raise WireError(f"bad tensor description {desc!r}.", "use [dtype string, [dims...]]")
        dtype, shape = np.dtype(desc[0]), tuple(desc[1])
        buf = _buffer(frame)
        if math.prod(shape) * dtype.itemsize != len(buf):
            raise WireError(f"tensor {desc!r} needs {math.prod(shape) * dtype.itemsize} bytes, frame has {len(buf)}.",
                            "send the array's full C-order bytes")
        arrays.append(np.frombuffer(buf, dtype=dtype).reshape(shape))
    return header, arrays


# How `deliver` went.
SENT, UNSENT, GONE = "sent", "unsent", "gone"


def send(sock: zmq.Socket, header: dict[str, Any], arrays: Sequence[np.ndarray] = (),
         to: bytes | None = None, block: bool = False) -> bool:
    """Send one message (to routing id `to` on a ROUTER); False when the peer cannot take it now."""
    return deliver(sock, header, arrays, to, block) == SENT


def deliver(sock: zmq.Socket, header: dict[str, Any], arrays: Sequence[np.ndarray] = (),
            to: bytes | None = None, block: bool = False) -> str:
    """Send one message and say how it went: SENT, UNSENT (the peer cannot take it now: its queue is full) or GONE
    (a ROUTER_MANDATORY socket has no peer with routing id `to`: its connection closed)."""
    frames = pack(header, arrays)
    if to is not None:
        frames = [to, *frames]
    try:
        sock.send_multipart(frames, flags=0 if block else zmq.NOBLOCK, copy=False)
    except zmq.ZMQError as exc:
        return GONE if exc.errno == zmq.EHOSTUNREACH else UNSENT
    return SENT


def _receive(sock: zmq.Socket, max_frames: int) -> list[zmq.Frame] | None:
    """The next message's frames, or None (its frames read and released one by one) when it has more than
    `max_frames`; raises zmq.Again when nothing waits."""
    frame = sock.recv(flags=zmq.NOBLOCK, copy=False)
    frames, n = [frame], 1
    while frame.more:
        frame = sock.recv(copy=False)
        n += 1
        if n <= max_frames:
            frames.append(frame)
    if n > max_frames:
        log.warning("dropping a message of %d frames (at most %d here)", n, max_frames)
        return None
    return frames


def drain(sock: zmq.Socket, routed: bool = False, limit: int | None = None,
          tensors: bool = False) -> Iterator[tuple[bytes | None, dict[str, Any], list[np.ndarray]]]:
    """(sender routing id or None, header, arrays) of each message waiting on `sock`, at most `limit`;
    malformed messages are logged and skipped. A control socket (`tensors` off) takes one header frame per
    message: ZeroMQ caps each frame's size (MAXMSGSIZE), so a frame count bounds a message's total."""
    max_frames = int(routed) + (1 + MAX_FRAMES if tensors else 1)
    n = 0
    while limit is None or n < limit:
        try:
            frames = _receive(sock, max_frames)
        except zmq.Again:
            return
        n += 1
        if frames is None:
            continue
        sender = None
        if routed:
            sender, frames = frames[0].bytes, frames[1:]
        try:
            header, arrays = unpack(frames)
        except WireError as exc:
            log.warning("dropping a malformed message: %s", exc)
            continue
        yield sender, header, arrays
