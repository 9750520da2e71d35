"""A server the runner did not start (`server.url`, `baseline.url`): measured as it stands. Its settings are read
back from it (experiments/engines/served.py) and stand in for the command line; its visits are kept on disk per
server instance, so a prompt it has served in an earlier run is known as seen."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil

from experiments.config.errors import Refused
from experiments.config.paths import cache_dir
from experiments.engines import adapter_for
from experiments.engines.auth import WANTS_KEY, auth_headers, use_key, wants_key
from experiments.engines.served import Served, expected_speculation, speculation_mismatch
from experiments.harness.server import EngineDied, VisitLog, listening_pids

HEALTH_TIMEOUT_S = 10.0
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
START_MATCH_S = 0.05   # /metrics' process start time and psutil's create time, both read from /proc


def visits_dir() -> Path:
    return cache_dir() / "server-visits"


class FileVisitLog(VisitLog):
    """A VisitLog that also appends every visit to a file (one JSON line each, under a lock), and starts from
    what the file holds: every runner on this machine that measures the same server instance shares it."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    self._counts[(row["prompt"], row["turn"])] += 1
        self.before = dict(self._counts)   # what earlier runs sent, for the contamination check

    def count(self, prompt_id: str, turn: int) -> int:
        visit = super().count(prompt_id, turn)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(json.dumps({"prompt": prompt_id, "turn": turn}) + "\n")
        return visit

    def seen_before(self, prompt_ids: set[str]) -> set[str]:
        """The prompts among `prompt_ids` that earlier runs sent to this server instance."""
        return {pid for pid, _ in self.before} & prompt_ids


class AttachedServer:
    """The Server interface the workload client uses (base_url, visits, check_alive), for a running server."""

    log_path: Path | None = None
    proc = None

    def __init__(self, served: Served, health_path: str) -> None:
        self.served, self.health_path = served, health_path
        self.base_url = served.url
        digest = hashlib.sha256(served.instance.encode()).hexdigest()[:16]
        self.visits = FileVisitLog(visits_dir() / f"{digest}.jsonl")

    @property
    def headers(self) -> dict[str, str]:
        """What every request to this server carries: its API key, if it wants one."""
        return auth_headers(self.base_url)

    def local_processes(self) -> list[psutil.Process]:
        """The server's processes where they run on this host: the one whose start time its /metrics gives (its
        tree holds the engine), and whatever listens on the URL's port here (a proxy in front of it)."""
        procs = {}
        if self.served.start_time:
            for proc in psutil.process_iter(["create_time"]):
                if abs((proc.info["create_time"] or 0.0) - self.served.start_time) < START_MATCH_S:
                    procs[proc.pid] = proc
        url = urlsplit(self.base_url)
        if url.hostname in LOCAL_HOSTS and url.port:
            for pid in listening_pids(url.port) - {None}:
                with contextlib.suppress(psutil.Error):
                    procs.setdefault(pid, psutil.Process(pid))
        return list(procs.values())

    def alive(self) -> bool:
        try:
            return httpx.get(self.base_url + self.health_path, headers=self.headers,
                             timeout=HEALTH_TIMEOUT_S).status_code == 200
        except httpx.HTTPError:
            return False

    def check_alive(self, wait_s: float = 0.0) -> None:
        """No process to poll: asked after a server-side error (wait_s > 0), the health endpoint decides."""
        if wait_s > 0 and not self.alive():
            raise EngineDied(f"the server at {self.base_url} no longer answers {self.health_path}")


def read_served(url: str, engine: str, health_path: str, api_key: str | None = None) -> Served:
    """The server's own settings, read with `api_key` (sent with every later request too); refused within seconds
    when nothing healthy answers at `url`, or when it wants a key (or another one) than the one given."""
    url = url.rstrip("/")
    use_key(url, api_key)
    try:
        status = httpx.get(url + health_path, headers=auth_headers(url), timeout=HEALTH_TIMEOUT_S).status_code
        models = httpx.get(url + "/v1/models", headers=auth_headers(url), timeout=HEALTH_TIMEOUT_S).status_code
    except httpx.HTTPError as exc:
        raise Refused(f"server.url={url}: no answer on {health_path} within {HEALTH_TIMEOUT_S:.0f} s "
                      f"({type(exc).__name__}); start the server or fix the URL") from None
    for code, path in ((status, health_path), (models, "/v1/models")):
        if code in WANTS_KEY:   # not a foreign or broken server: one that wants a key
            raise Refused(wants_key(url, code, path))
    if status != 200:
        raise Refused(f"server.url={url}: {health_path} answers HTTP {status}, not 200: not a healthy {engine} server")
    try:
        return adapter_for(engine).read_served(url)
    except NotImplementedError as exc:
        raise Refused(f"server.url: {exc}") from None


def check_speculation(served: Served, method: str, num_steps: int | None, num_draft_tokens: int | None,
                      option: str) -> None:
    """A running server is measured as the option only when it runs the option's speculation."""
    why = speculation_mismatch(expected_speculation(served.engine, method, num_steps, num_draft_tokens),
                               served.speculation)
    if why:
        raise Refused(f"the server at {served.url} is not option {option}'s: {why} (read back from "
                      f"{', '.join(served.sources) or 'nothing'})")


def check_first_visits(server: AttachedServer, measured: set[str], reuse_prompts: bool) -> int:
    """A running server that earlier runs sent some of this run's measured prompts is refused (its caches
    would measure those visits), unless the workload reuses prompts; returns how many were seen."""
    seen = server.visits.seen_before(measured)
    if seen and not reuse_prompts:
        raise Refused(f"the server at {server.base_url} has already served {len(seen)} of this run's "
                      f"{len(measured)} measured prompts (visits kept in {server.visits.path}): restart it, measure "
                      "other prompts (workload.seed / num_prompts / prompt_set), or set workload.reuse_prompts=true")
    return len(seen)
