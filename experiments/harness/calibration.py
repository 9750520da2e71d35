"""The host calibration of a run: experiments/harness/host_probe.py kept running in the serving interpreter
(`--serve`: torch imported and the CUDA context made once), sampled before and after every level and between its
blocks, and the engine's own CPU time over each level (`EngineCpu`).

Metrics, per level c (terms of host_probe.py, in microseconds):
- `host_<term>_c<c>_before` / `_after`: the level's first and last sample;
- `host_state_change_c<c>`: the largest swing of a KEY_TERMS term within the level, max / min - 1 over all its
  samples (each sample a median of its repeats, so one preempted repeat does not move it);
- `host_state_changed_c<c>` = 1 where that swing exceeds CHANGE_THRESHOLD (0.25: the two host states seen on the
  H200 differed by ~60 % in the loop and ~35 % in the launch, repeat-to-repeat noise of a median is a few %);
- `host_engine_cpu_s_c<c>`, `host_engine_cpu_ms_per_tok_c<c>`: CPU seconds of the engine's processes over the
  level (per output token), `host_engine_busiest_share_c<c>`: the busiest process's CPU seconds per wall second
  (1.0 = a full core: SGLang's scheduler then bounds the step).
States: the run's samples are split into `fast` and `slow` at the widest gap of STATE_TERM's values where that
gap exceeds CHANGE_THRESHOLD, else every sample is `one` (relative to this run only; compare runs with
experiments.analysis.diff)."""
from __future__ import annotations

import json
import math
import os
import selectors
import subprocess
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import psutil

from experiments.config.paths import ROOT

KEY_TERMS = ("py_loop_us", "launch_us")
STATE_TERM = "py_loop_us"
CHANGE_THRESHOLD = 0.25
PROBE_TIMEOUT_S = 60.0     # the first answer includes torch's import and the CUDA context
ARTIFACT = "host_calibration.json"


@dataclass
class ProbeSample:
    level: int
    block: int | str
    when: str                     # before | after | between
    unix: float
    terms: dict[str, float]
    spread: dict[str, float] = field(default_factory=dict)
    state: str = ""


class ProbeProcess:
    """host_probe.py --serve in `python` with the server's `env`: one JSON line per request."""

    def __init__(self, python: str, env: dict[str, str] | None = None, device: str = "auto") -> None:
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([python, "-m", "experiments.harness.host_probe", "--serve", "--device", device],
                                     cwd=ROOT, env={**os.environ, **(env or {})}, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr)
        self._buffer = b""

    def ask(self, timeout_s: float) -> dict:
        """One sample; RuntimeError (with the probe's stderr) where it died or did not answer in time."""
        try:
            self.proc.stdin.write(b"probe\n")
            self.proc.stdin.flush()
        except BrokenPipeError:   # it died before the question: the same answer as dying before the reply
            raise RuntimeError(f"the probe exited ({self.proc.wait()}){self._why()}") from None
        return json.loads(self._line(timeout_s))

    def _line(self, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise RuntimeError(f"the probe did not answer in {timeout_s:.0f} s{self._why()}")
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise RuntimeError(f"the probe exited ({self.proc.wait()}){self._why()}")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _why(self) -> str:
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace").strip()[-500:]
        return f": {tail}" if tail else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b"q\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


class EngineCpu:
    """CPU seconds of the engine's processes (user + system, each process on its own) between `start` and
    `stop`, per process, labelled by its title (SGLang names its scheduler `sglang::scheduler`)."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[float, dict[int, tuple[str, float]]]] = {}
        self.windows: dict[str, dict] = {}

    def start(self, key: str, processes: Iterable[psutil.Process]) -> None:
        self._open[key] = (time.monotonic(), {p.pid: r for p in processes if (r := _cpu(p)) is not None})

    def stop(self, key: str, output_tokens: float | None = None) -> dict:
        t0, first = self._open.pop(key)
        wall = time.monotonic() - t0
        per = {}
        for pid, (label, s0) in first.items():
            now = _cpu_of(pid)
            if now is not None:
                per[f"{label}[{pid}]"] = max(0.0, now - s0)
        total = sum(per.values())
        out = {"wall_s": wall, "cpu_s": total, "per_process_s": per,
               "busiest_share": max(per.values(), default=0.0) / wall if wall > 0 else 0.0}
        if output_tokens:
            out["output_tokens"], out["ms_per_token"] = output_tokens, 1000.0 * total / output_tokens
        self.windows[key] = out
        return out


def server_processes(server) -> list[psutil.Process]:
    """The engine's processes: a started server's (harness/server.py `Server`) process and its descendants (SGLang's
    scheduler and detokenizer, vLLM's EngineCore); an attached server's (`server.url`) own local processes."""
    proc = getattr(server, "proc", None)
    if proc is None:
        return list(server.local_processes())
    try:
        root = psutil.Process(proc.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _cpu(p: psutil.Process) -> tuple[str, float] | None:
    try:
        with p.oneshot():
            t = p.cpu_times()
            cmd = p.cmdline()
            label = cmd[0] if cmd and cmd[0].startswith("sglang::") else p.name()
            return label, t.user + t.system
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _cpu_of(pid: int) -> float | None:
    try:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def label_states(samples: list[ProbeSample], term: str = STATE_TERM, threshold: float = CHANGE_THRESHOLD) -> None:
    """Each sample's `state`: `fast` / `slow` on either side of the widest gap of `term` (in log space) where
    that gap exceeds `threshold`, else `one`; a sample without the term gets none."""
    values = sorted(s.terms[term] for s in samples if s.terms.get(term))
    gaps = [(math.log(b / a), b) for a, b in zip(values, values[1:], strict=False) if a > 0]
    widest = max(gaps, default=(0.0, math.inf))
    for s in samples:
        v = s.terms.get(term)
        if v:
            s.state = "one" if widest[0] <= math.log1p(threshold) else ("slow" if v >= widest[1] else "fast")


def swing(samples: list[ProbeSample], term: str) -> float | None:
    """max / min - 1 of `term` over `samples` (None with fewer than two)."""
    values = [s.terms[term] for s in samples if s.terms.get(term)]
    return max(values) / min(values) - 1.0 if len(values) > 1 else None


class HostCalibration:
    """A run's calibration: `before(c, block)` / `after(c, block)` probe samples (`between` too), `engine_start` /
    `engine_stop` around each level with the server's processes; `metrics()`, `tags()` and `to_dict()` (the
    `host_calibration.json` artifact) at the end; `close()` on every way out. A probe that cannot start or stops
    answering turns the calibration off (`status` says why); it never fails the run."""

    def __init__(self, python: str | None, env: dict[str, str] | None = None, device: str = "auto",
                 timeout_s: float = PROBE_TIMEOUT_S) -> None:
        """`python`: the serving interpreter (LaunchSpec.python) and `env` the server's (LaunchSpec.env); None for
        a server whose interpreter is unknown (`server.url`): then only the engine's CPU time is measured."""
        self.python, self.device, self.timeout_s = python, device, timeout_s
        self.samples: list[ProbeSample] = []
        self.engine = EngineCpu()
        self.info: dict = {}
        self.status = "on"
        self.probe: ProbeProcess | None = None
        if python is None:
            self.status = "off: no serving interpreter to probe in"
            return
        try:
            self.probe = ProbeProcess(python, env, device)
        except OSError as exc:
            self.status = f"off: the probe did not start ({exc})"

    def sample(self, level: int, when: str, block: int | str = 0) -> ProbeSample | None:
        """One probe sample labelled (level, block, when); None once the probe is off."""
        if self.probe is None:
            return None
        try:
            answer = self.probe.ask(self.timeout_s)
            s = ProbeSample(level, block, when, answer["unix"], answer["terms"], answer.get("spread", {}))
        except (RuntimeError, OSError, ValueError, KeyError) as exc:
            self.status = f"off: {exc}"
            self.close()
            return None
        self.info = {k: answer.get(k) for k in ("device", "torch", "python", "skipped", "setup_s")}
        self.samples.append(s)
        return s

    def before(self, level: int, block: int | str = 0) -> ProbeSample | None:
        return self.sample(level, "before", block)

    def after(self, level: int, block: int | str = 0) -> ProbeSample | None:
        return self.sample(level, "after", block)

    def engine_start(self, level: int, processes: Iterable[psutil.Process], block: int | str = 0) -> None:
        self.engine.start(f"c{level}/{block}", processes)

    def engine_stop(self, level: int, output_tokens: float | None = None, block: int | str = 0) -> dict:
        return self.engine.stop(f"c{level}/{block}", output_tokens)

    def levels(self) -> dict[int, dict]:
        """Per level: its first and last sample, the largest swing of each key term, whether it changed state."""
        label_states(self.samples)
        out: dict[int, dict] = {}
        for level in sorted({s.level for s in self.samples}):
            own = sorted((s for s in self.samples if s.level == level), key=lambda s: s.unix)
            swings = {t: v for t in KEY_TERMS if (v := swing(own, t)) is not None}
            out[level] = {"first": own[0], "last": own[-1], "swing": swings,
                          "changed": any(v > CHANGE_THRESHOLD for v in swings.values()),
                          "states": sorted({s.state for s in own if s.state})}
        return out

    def metrics(self) -> dict[str, float]:
        """The `host_*` metrics of the module's docstring."""
        out: dict[str, float] = {}
        for level, lv in self.levels().items():
            for when, s in (("before", lv["first"]), ("after", lv["last"])):
                out |= {f"host_{t}_c{level}_{when}": v for t, v in s.terms.items()}
            if lv["swing"]:
                out[f"host_state_change_c{level}"] = max(lv["swing"].values())
                out[f"host_state_changed_c{level}"] = float(lv["changed"])
        return out | self._engine_metrics()

    def _engine_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        tokens: dict[str, float] = {}
        for key, w in self.engine.windows.items():
            level = key.split("/")[0]
            out[f"host_engine_cpu_s_{level}"] = out.get(f"host_engine_cpu_s_{level}", 0.0) + w["cpu_s"]
            share = f"host_engine_busiest_share_{level}"
            out[share] = max(out.get(share, 0.0), w["busiest_share"])
            tokens[level] = tokens.get(level, 0.0) + w.get("output_tokens", 0.0)
        for level, n in tokens.items():
            if n:
                out[f"host_engine_cpu_ms_per_tok_{level}"] = 1000.0 * out[f"host_engine_cpu_s_{level}"] / n
        return out

    def changed(self) -> dict[int, str]:
        """Level -> why it is flagged (a key term swung by more than CHANGE_THRESHOLD within it)."""
        out = {}
        for level, lv in self.levels().items():
            if lv["changed"]:
                term, value = max(lv["swing"].items(), key=lambda kv: kv[1])
                lo = min(s.terms[term] for s in self.samples if s.level == level and s.terms.get(term))
                out[level] = f"{term} swung {value:+.0%} from {lo:.3g} µs within the level"
        return out

    def tags(self) -> dict[str, str]:
        """`host.calibration`: on / off (why); `host.state_changed`: the flagged levels or `none`;
        `host.states`: the states seen."""
        flagged = self.changed()
        states = sorted({s.state for s in self.samples if s.state})
        return {"host.calibration": self.status,
                "host.state_changed": "; ".join(f"c{c}: {why}" for c, why in flagged.items()) or "none",
                "host.states": ",".join(states) or "none"}

    def to_dict(self) -> dict:
        """The `host_calibration.json` artifact."""
        levels = {str(c): {"swing": lv["swing"], "changed": lv["changed"], "states": lv["states"]}
                  for c, lv in self.levels().items()}
        return {"status": self.status, "python": self.python, "probe": self.info, "key_terms": list(KEY_TERMS),
                "state_term": STATE_TERM, "threshold": CHANGE_THRESHOLD, "levels": levels,
                "changed": {str(c): why for c, why in self.changed().items()},
                "samples": [asdict(s) for s in self.samples], "engine_cpu": self.engine.windows}

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
            self.probe = None
