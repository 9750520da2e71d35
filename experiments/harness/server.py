"""The engine server as a process group on 127.0.0.1: log to a file, health awaited, always torn down.

Across processes (two runners, a submitit sweep's jobs): each process owns and stops only the servers it started;
a port is held from its choice until its server listens (ports.hold_port), and a pooled server holds its devices
(devices.DEVICES) while it lives, so a second job on the same devices waits for them."""
from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter, OrderedDict
from pathlib import Path

import httpx
import psutil
from rich.console import Console

from experiments.config.errors import Refused
from experiments.engines.auth import WANTS_KEY, auth_headers, use_key, wants_key
from experiments.harness.devices import DEVICES, device_ids, lock_dir
from experiments.harness.launch import LaunchSpec
from experiments.harness.ports import free_port, hold_port
from experiments.tracking.redact import redact_file, redact_text

PORT_IN_USE = ("address already in use", "errno 98")
POLL_GRACE_S = 3.0   # the watchdog notices a gone group within one poll (1 s)
HEARTBEAT_S = 15.0   # a line while a server starts: seconds so far and the phase its log is in
# (pattern, phase) for a server log's lines, vLLM's and SGLang's; the last line that matches one names the phase
PHASES = (
    (re.compile(r"Uvicorn running|Starting vLLM server|Application startup|fired up|Started server process"),
     "starting its HTTP server"),
    (re.compile(r"[Cc]apture cuda graph|[Cc]apturing (CUDA|cuda)|CUDA graph"), "capturing CUDA graphs"),
    (re.compile(r"[Cc]ompil(e|ing|ation)|Dynamo|torch\.compile|[Aa]utotun"), "compiling"),
    (re.compile(r"KV [Cc]ache|kv cache|[Mm]emory pool|init engine|[Ww]arm(ing)? ?up|[Pp]rofil"),
     "allocating the KV cache, warming up"),
    (re.compile(r"[Ll]oad(ing)? (model|weight)|safetensors|[Cc]heckpoint shards|to load model"), "loading weights"),
    (re.compile(r"Initializing a V1|init_distributed|[Ii]nit torch distributed|world_size="),
     "initialising the engine"),
)
NOT_A_PHASE = re.compile(r"disabl|deprecat|enforce.eager", re.IGNORECASE)   # names a phase it skips
SOURCE_PREFIX = re.compile(r"^.*?\[[\w./-]+\.py:\d+\]\s*")   # vLLM's "(pid) INFO date [file.py:12] "
console = Console(stderr=True)


class EngineStartError(RuntimeError):
    """The server exited or never became healthy; carries the tail of its log."""


class ForeignServer(EngineStartError):
    """Something answers on the server's port that is not the process this runner started."""


class ServerWantsKey(EngineStartError, Refused):
    """The server answers 401/403: it wants an API key (or another one); not a foreign server, nothing relaunched."""


class EngineDied(RuntimeError):
    """The server process ended while the workload was running."""


def startup_phase(path: Path, tail_bytes: int = 32768) -> str:
    """The phase a starting server is in, read from the end of its log (PHASES)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return "no log yet"
    for line in reversed(lines):
        line = SOURCE_PREFIX.sub("", line)
        if NOT_A_PHASE.search(line):
            continue
        for pattern, phase in PHASES:
            if pattern.search(line):
                return phase
    return "starting Python, importing the engine"


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no server log)"


class VisitLog:
    """Which prompts a server has served, and how often: engines keep state across requests (SGLang's NGRAM
    cache), so a prompt's second visit to one server is not a first-seen measurement."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, int]] = Counter()

    def count(self, prompt_id: str, turn: int) -> int:
        """Counts one more request of this prompt and turn; returns its visit number (1 = first seen)."""
        self._counts[(prompt_id, turn)] += 1
        return self._counts[(prompt_id, turn)]

    def seen(self, prompt_ids: set[str]) -> set[str]:
        """The prompts among `prompt_ids` already served (in any turn)."""
        return {pid for pid, _ in self._counts} & prompt_ids


class Server:
    """The one owner of a server process: the command line of a LaunchSpec (an engine, the loopback test server,
    a benchmark's peer) started in its own process group on a free port, its output in `log_path`, healthy
    before `start` returns, the whole group stopped by `stop`."""

    heartbeat_s = HEARTBEAT_S

    def __init__(self, spec: LaunchSpec, log_path: Path, label: str = "") -> None:
        self.spec = spec
        self.log_path = log_path
        self.label = label   # what the heartbeat names it by (the option)
        self.proc: subprocess.Popen | None = None
        self._watchdog: subprocess.Popen | None = None
        self.visits = VisitLog()

    @property
    def base_url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    @property
    def headers(self) -> dict[str, str]:
        """What every request to this server carries: its API key, if it wants one."""
        return auth_headers(self.base_url)

    def start(self, timeout_s: float, preferred_port: int | None = None, attempts: int = 3,
              health_poll_s: float = 1.0) -> None:
        """Start and wait for health (asked every `health_poll_s`); a port lost to another process between
        choice and bind is replaced by a fresh free port."""
        for attempt in range(attempts):
            hold = self._choose_port(preferred_port if attempt == 0 else None)
            try:
                self._start_once(timeout_s, health_poll_s)
                return
            except EngineStartError as exc:
                retry = isinstance(exc, ForeignServer) or any(s in str(exc).lower() for s in PORT_IN_USE)
                if attempt + 1 < attempts and retry:
                    continue
                raise
            finally:   # listening (or gone): the port no longer looks free to anyone
                hold.release()

    def _choose_port(self, preferred: int | None, tries: int = 100):
        """A free port that no other process of this host is starting a server on, held until released."""
        for _ in range(tries):
            self.spec.port = free_port(preferred, self.spec.host)
            hold = hold_port(lock_dir(), self.spec.port)
            if hold is not None:
                return hold
            preferred = None
        raise OSError(f"every free port tried on {self.spec.host} is being taken by another workspace process")

    def _start_once(self, timeout_s: float, health_poll_s: float) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        use_key(self.base_url, self.spec.api_key)
        log = open(self.log_path, "ab")
        log.write(f"$ {redact_text(' '.join(self.spec.argv))}\n".encode())
        log.flush()
        env = {**os.environ, **self.spec.env}
        self.proc = subprocess.Popen(self.spec.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)  # own process group: killed as a whole
        log.close()
        self._watchdog = _start_watchdog(self.proc.pid)
        try:
            self._await_health(timeout_s, health_poll_s)
            self._check_identity()
        except BaseException:  # Ctrl-C / SIGTERM while starting: leave nothing behind
            self.stop()
            raise

    def _await_health(self, timeout_s: float, poll_s: float) -> None:
        start = time.monotonic()
        deadline, beat = start + timeout_s, start + self.heartbeat_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.heartbeat_s and time.monotonic() >= beat:
                    beat += self.heartbeat_s
                    self._heartbeat(time.monotonic() - start)
                if self.proc.poll() is not None:
                    code = self.proc.returncode
                    raise EngineStartError(f"{self.spec.engine} server exited with code {code} before "
                                           f"becoming healthy. Server log ({self.log_path}) ends with:\n"
                                           f"{log_tail(self.log_path)}")
                try:
                    if client.get(self.base_url + self.spec.health_path).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(poll_s)
        raise EngineStartError(f"{self.spec.engine} server not healthy after {timeout_s:.0f} s. "
                               f"Server log ({self.log_path}) ends with:\n{log_tail(self.log_path)}")

    def _heartbeat(self, elapsed_s: float) -> None:
        who = f"{self.label}: " if self.label else ""
        console.print(f"{who}{self.spec.engine} starting, {elapsed_s:.0f} s: {startup_phase(self.log_path)}",
                      markup=False, highlight=False)

    def _check_identity(self) -> None:
        """A healthy port is ours only if our process is alive, listens on it, and serves the model we asked for
        (vLLM and SGLang both list the served model name on /v1/models): another runner's or a stale server on a
        fixed `server.port` would otherwise be measured."""
        where = f"{self.spec.host}:{self.spec.port}"
        if self.proc.poll() is not None:
            raise ForeignServer(f"{where} answers health, but the {self.spec.engine} server this runner started "
                                f"exited (code {self.proc.returncode}): another process holds the port. Server log "
                                f"({self.log_path}) ends with:\n{log_tail(self.log_path)}")
        listening = listening_pids(self.spec.port)   # None in it: a process we may not see (another user's)
        if listening and None not in listening and not listening & _our_pids(self.proc.pid):
            raise ForeignServer(f"{where} is served by pid(s) {sorted(listening)}, not by the {self.spec.engine} "
                                f"server this runner started (pid {self.proc.pid}): another runner's or a stale "
                                "server holds the port; stop it or leave server.port=null")
        name = served_model_name(self.spec.args)
        if name is None:
            return
        try:
            reply = httpx.get(self.base_url + "/v1/models", headers=self.headers, timeout=10.0)
            if reply.status_code in WANTS_KEY:
                raise ServerWantsKey(wants_key(self.base_url, reply.status_code, "/v1/models"))
            served = [m.get("id") for m in reply.json()["data"]]
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ForeignServer(f"{where} does not list its models on /v1/models ({exc}): not the "
                                f"{self.spec.engine} server this runner started") from None
        if name not in served:
            raise ForeignServer(f"{where} serves {served}, not {name!r}: not the server this runner started; "
                                "stop the other server or leave server.port=null")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def local_processes(self) -> list[psutil.Process]:
        """Processes serving this server outside the runner's own tree: none, the runner started it."""
        return []

    def check_alive(self, wait_s: float = 0.0) -> None:
        """Raise EngineDied if the server has exited (waiting up to `wait_s` for it to finish dying)."""
        if self.proc is not None and wait_s > 0:
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
        if self.proc is not None and self.proc.poll() is not None:
            raise EngineDied(f"{self.spec.engine} server died (exit code {self.proc.returncode}). "
                             f"Server log ends with:\n{log_tail(self.log_path)}")

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after `grace_s`."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        procs = _group_members(pgid)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
            _, alive = psutil.wait_procs(procs, timeout=grace_s if sig == signal.SIGTERM else 2.0)
            if not alive:
                break
            procs = alive
        try:
            self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None
        try:   # the group is gone: nothing writes the log any more
            redact_file(self.log_path)
        except OSError:
            pass
        if self._watchdog is not None:   # it ends by itself once the group is gone; reap it
            try:
                self._watchdog.wait(timeout=POLL_GRACE_S)
            except subprocess.TimeoutExpired:
                self._watchdog.kill()
            self._watchdog = None


def _start_watchdog(pgid: int) -> subprocess.Popen:
    """A process of its own session that takes the engine's group down if this runner dies without stopping it
    (experiments/harness/watchdog.py)."""
    me = psutil.Process()
    return subprocess.Popen([sys.executable, "-m", "experiments.harness.watchdog", str(me.pid),
                             repr(me.create_time()), str(pgid)], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def served_model_name(args: list[str]) -> str | None:
    """The name the server answers to (`--served-model-name`), or None when the command line sets none."""
    for i, arg in enumerate(args):
        if arg == "--served-model-name" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--served-model-name="):
            return arg.split("=", 1)[1]
    return None


def listening_pids(port: int) -> set[int | None]:
    """The processes listening on `port` (None for one this user may not see); empty when none can be listed."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return set()
    return {c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port}


def _our_pids(pid: int) -> set[int]:
    """The server process, its process group and its descendants (one that left the group included)."""
    ours = {pid} | {p.pid for p in _group_members(pid)}
    try:
        ours |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        pass
    return ours


def _group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


class ServerPool:
    """This process's running servers keyed by launch-spec identity (command line and environment), so multirun
    jobs of one process with the same arguments share one server; never shared with another process. Least
    recently used servers are stopped beyond `capacity`. A server started for an `accelerator` holds its devices
    while it lives: one for a device another process holds waits for it."""

    def __init__(self) -> None:
        self._servers: OrderedDict[str, Server] = OrderedDict()
        self._devices: dict[str, list[str]] = {}
        self.accelerator: str | None = None   # the running job's site.accelerator (experiments/harness/sweep.py)
        atexit.register(self.close_all)

    def acquire(self, spec: LaunchSpec, log_path: Path, timeout_s: float, preferred_port: int | None,
                reuse: bool = True, capacity: int = 2, accelerator: str | None = None,
                label: str = "") -> tuple[Server, bool]:
        """A healthy server for `spec` and whether it was reused; `label` names it in the start's heartbeat."""
        server = self._servers.get(spec.key) if reuse else None
        if server is not None and server.alive():
            self._servers.move_to_end(spec.key)
            spec.port = server.spec.port
            return server, True
        self.release(spec.key)
        while len(self._servers) >= max(1, capacity):
            self.release(next(iter(self._servers)))
        accelerator = accelerator or self.accelerator
        devices = device_ids(accelerator, spec.env) if accelerator else []
        DEVICES.acquire(devices, f"{spec.engine} server of {_command_line()}")
        server = Server(spec, log_path, label)
        try:
            server.start(timeout_s, preferred_port)
        except BaseException:
            DEVICES.release(devices)
            raise
        self._servers[spec.key] = server
        self._devices[spec.key] = devices
        return server, False

    def release(self, key: str) -> None:
        server = self._servers.pop(key, None)
        if server is not None:
            server.stop()
            DEVICES.release(self._devices.pop(key, []))

    def close_all(self) -> None:
        for key in list(self._servers):
            self.release(key)


POOL = ServerPool()


def _command_line(limit: int = 240) -> str:
    """This process's command line, as a waiting job's progress line names the holder (secrets masked)."""
    line = redact_text(" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
    return line if len(line) <= limit else line[:limit] + "..."
