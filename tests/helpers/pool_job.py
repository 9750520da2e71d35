"""A job that takes a loopback server from the engine-server pool for the CPU device, as a runner's job would, holds
it until `go` exists, checks it is still its own and healthy, then closes the pool. Lines on stdout say what it did:
`STARTED <time> <server pid> <port>`, `ALIVE <time>`, `DONE <time>`."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx

from experiments.config.paths import ROOT
from experiments.harness.launch import LaunchSpec
from experiments.harness.server import POOL
from tests.helpers.loopback_server import MODULE


def main(name: str, go: Path, log: Path) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    spec = LaunchSpec(engine="loopback", python=sys.executable, module=MODULE, health_path="/health", env=env,
                      args=["--ttft-ms", "1", "--itl-ms", "1", "--served-model-name", name])
    server, _ = POOL.acquire(spec, log, 30, None, accelerator="cpu")
    print(f"STARTED {time.time()} {server.proc.pid} {server.spec.port}", flush=True)
    while not go.exists():
        time.sleep(0.1)
    served = [m["id"] for m in httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"]]
    assert server.alive() and served == [name], (server.alive(), served)
    print(f"ALIVE {time.time()}", flush=True)
    POOL.close_all()
    print(f"DONE {time.time()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
