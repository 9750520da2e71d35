"""Free local ports: the workspace's only port helper (servers, vLLM's one-process distributed group, tests).
Standard library only: experiments/eagle3/vllm_load_check.py imports it inside vLLM's interpreter."""
from __future__ import annotations

import random
import socket

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
