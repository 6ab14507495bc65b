"""Framing between the trainer and a launcher: a 4-byte big-endian length, then a JSON object.

Bytes travel base64-encoded (`pack_bytes` / `unpack_bytes`). Both ends use raw file descriptors, so nothing
is buffered behind the other side's back. Standard library only: the launcher imports this by file path.
"""

from __future__ import annotations

import base64
import json
import os
import struct

MAX_FRAME_BYTES = 1 << 30


def send(fd: int, message: dict) -> None:
    payload = json.dumps(message, separators=(",", ":")).encode()
    data = struct.pack(">I", len(payload)) + payload
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _read_exact(fd: int, size: int) -> bytes | None:
    chunks, remaining = [], size
    while remaining:
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def recv(fd: int) -> dict | None:
    """The next message, or None when the other end has closed its pipe."""
    header = _read_exact(fd, 4)
    if header is None:
        return None
    (size,) = struct.unpack(">I", header)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {size} bytes is larger than {MAX_FRAME_BYTES}")
    payload = _read_exact(fd, size)
    if payload is None:
        return None
    return json.loads(payload)


def pack_bytes(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unpack_bytes(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))
