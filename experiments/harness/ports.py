"""Free local ports: the workspace's only port helper (servers, vLLM's one-process distributed group, tests).
`free_port` is standard library only: experiments/eagle3/vllm_load_check.py imports it inside vLLM's interpreter.
`hold_port` keeps a chosen port from this host's other workspace processes until its server listens."""
from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from filelock import FileLock

# Not the kernel's ephemeral range (32768-60999): SGLang derives more ports from this one (0.5.14 refused
# SGLANG_GRPC_PORT = port + 10000 > 65535).
PORT_RANGE = (20000, 32000)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(preferred: int | None = None, host: str = "127.0.0.1") -> int:
    """`preferred` when it is free, otherwise a free port in PORT_RANGE."""
    if preferred and port_is_free(preferred, host):
        return preferred
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(*PORT_RANGE)
        if port_is_free(port, host):
            return port
    raise OSError(f"no free port in {PORT_RANGE} on {host}")


def hold_port(folder: Path, port: int) -> FileLock | None:
    """An OS file lock on `port` under `folder`, or None when another process holds it. A server's starter holds
    its port from choosing it until the server listens (a vLLM start takes a minute): meanwhile the port still
    looks free to this host's other jobs. The lock ends with its process, however it ends."""
    from filelock import FileLock, Timeout  # here: free_port stays importable without it

    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(folder / f"port-{port}.lock", thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return None
    return lock
