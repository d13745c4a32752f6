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


MAX_REQUEST = 1 << 20


def listen(path: Path, mode: int = 0o600) -> socket.socket:
    """A listening socket at ``path``; by default only its owner can connect to it."""
    path.unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        server.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, mode)
    server.listen(64)
    server.setblocking(False)
    return server


def peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return _PEERCRED.unpack(creds)[1]


def read_message(
    conn: socket.socket, limit: int = MAX_REQUEST, *, strict: bool = False
) -> dict[str, Any] | None:
    """One JSON object on one line; None when it is not one (``strict``: ValueError saying
    what is wrong, to be answered)."""
    data = b""
    problem = None
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            problem = "the request ended before its end of line"
            break
        data += chunk
        if len(data) > limit:
            problem = f"request too large (over {limit} bytes)"
            break
    message = None
    if problem is None:
        try:
            message = json.loads(data)
        except ValueError:
            problem = "a request is one JSON object on one line"
        else:
            if not isinstance(message, dict):
                problem, message = "a request is one JSON object on one line", None
    if problem is not None and strict:
        raise ValueError(problem)
    return message


def answer(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")
