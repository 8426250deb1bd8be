"""Length-prefixed pickle frames over a socket: the harness's wire format."""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

_HEADER = struct.Struct("!Q")


def send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks = []
    while n:
        try:
            chunk = sock.recv(min(n, 1 << 20))
        except ConnectionResetError:  # the peer died with our bytes unread: closed, too
            return None
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket) -> Any:
    """The next object, or None if the peer closed the connection."""
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    data = _recv_exact(sock, _HEADER.unpack(header)[0])
    return None if data is None else pickle.loads(data)
