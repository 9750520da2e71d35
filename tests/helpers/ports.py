"""A URL nothing answers at: a port the kernel handed out and that was closed again."""
from __future__ import annotations

import socket


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"
