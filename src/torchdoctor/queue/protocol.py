"""The scheduler's socket: one JSON line in, one JSON line out, from this user only.

The socket file is mode 0600 in a 0700 folder, and the scheduler also checks the peer's
credentials (SO_PEERCRED), so no other user reaches a queue even where permissions are lax.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def request(path: Path, message: dict[str, Any], timeout_s: float = 10.0) -> dict[str, Any]:
    """Send one request to the scheduler; its answer. OSError when none listens."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        conn.connect(str(path))
        conn.sendall(json.dumps(message).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk:
                raise ConnectionError("the scheduler closed the connection without an answer")
            data += chunk
    return json.loads(data)


def listen(path: Path) -> socket.socket:
    """A listening socket at ``path`` that only its owner can connect to."""
    path.unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        server.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    server.listen(64)
    server.setblocking(False)
    return server


def peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return _PEERCRED.unpack(creds)[1]


def read_message(conn: socket.socket, limit: int = 1 << 20) -> dict[str, Any] | None:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
        if len(data) > limit:
            return None
    try:
        message = json.loads(data)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


def answer(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")
