"""What a server's host does around every measured slice (a level's block or repetition): the host's window (load,
steal, CPU clock: experiments/harness/fingerprint.py), the calibration probe before and after it and the engine's
own CPU time over it (experiments/harness/calibration.py), and the level telemetry inside it. The workload client
calls `start(level, rep)` / `stop()` around each slice as it would the telemetry alone; the probe runs outside the
telemetry's window, so its few milliseconds stay out of what is measured."""
from __future__ import annotations

from experiments.harness.calibration import HostCalibration, server_processes
from experiments.harness.fingerprint import HostRecord, collect_host
from experiments.harness.telemetry import LevelTelemetry


class HostWatch:
    def __init__(self, telemetry: LevelTelemetry, host: HostRecord, calibration: HostCalibration, server) -> None:
        self.telemetry, self.host, self.calibration, self.server = telemetry, host, calibration, server
        self._slice: tuple[int, int] | None = None

    @classmethod
    def open(cls, telemetry: LevelTelemetry, server, engine: str, python: str | None, env: dict[str, str] | None,
             accelerator: str, head: str | None, visible: str | None, log_path) -> HostWatch:
        """After the server is healthy (its CUDA graphs are captured by then): the host's facts, the probe started
        in the serving interpreter (`python` None for a running server of server.url: no probe)."""
        host = collect_host(engine, server.base_url, log_path, python, env, head, visible)
        device = "cuda" if accelerator == "cuda" else "cpu"
        return cls(telemetry, host, HostCalibration(python, env, device), server)

    def start(self, level: int, rep: int) -> None:
        self._slice = (level, rep)
        self.host.start(level, rep)
        self.calibration.before(level, rep)
        self.calibration.engine_start(level, server_processes(self.server), rep)
        self.telemetry.start(level, rep)

    def stop(self) -> None:
        self.telemetry.stop()
        if self._slice is None:
            return
        level, rep = self._slice
        self.calibration.engine_stop(level, None, rep)
        self.calibration.after(level, rep)
        self.host.stop(level, rep)
        self._slice = None

    def output_tokens(self, per_slice: dict[tuple[int, int], float]) -> None:
        """The slices' output tokens, for the engine's CPU time per token (known once the records are in)."""
        for (level, rep), tokens in per_slice.items():
            window = self.calibration.engine.windows.get(f"c{level}/{rep}")
            if window is not None:
                window["output_tokens"] = tokens

    def metrics(self) -> dict[str, float]:
        return self.host.metrics() | self.calibration.metrics()

    def tags(self) -> dict[str, str]:
        return self.calibration.tags()

    def changed(self) -> dict[int, str]:
        return self.calibration.changed()

    def close(self) -> tuple[dict, dict]:
        """host.json's and host_calibration.json's contents; the probe stopped."""
        self.calibration.close()
        return self.host.to_dict(), self.calibration.to_dict()
