"""A shared tracking server: Debian's PostgreSQL as MLflow's backend store and `mlflow server` proxying the
artifacts into a folder, both kept in one folder. `bin/tracking-server <folder>` (this module's `main`) runs it
for a team; the tests start the same pair on free ports (docs/reference/team.md).

Layout of <folder>: pg/ (the database cluster), pg-password (the database role's password, 0600), artifacts/,
postgres.log, mlflow.log. PostgreSQL listens on 127.0.0.1 only, with a password: the MLflow server is its one
client and gets the password in its environment (PGPASSWORD), never on a command line.
"""
from __future__ import annotations

import argparse
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

DB_ROLE = "specws"          # the cluster's superuser role (a database role, not an OS user)
DATABASE = "mlflow"
OS_USER = "postgres"        # PostgreSQL refuses to run as root: as root, the cluster runs as this user
INSTALL_HINT = "apt-get install -y postgresql (Debian's package; .ci/run installs it)"


class PostgresMissing(RuntimeError):
    """PostgreSQL's server binaries are not installed; the message says how to install them."""


def postgres_bin() -> Path:
    """The folder of initdb and pg_ctl: Debian's newest /usr/lib/postgresql/<version>/bin, else the PATH's."""
    found = [p.parent for p in Path("/usr/lib/postgresql").glob("*/bin/initdb")]
    found.sort(key=lambda b: int(b.parent.name) if b.parent.name.isdigit() else 0)
    if found:
        return found[-1]
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(on_path).resolve().parent
    raise PostgresMissing(f"PostgreSQL's server binaries (initdb, pg_ctl) are not installed: {INSTALL_HINT}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _as_owner(cmd: list[str]) -> list[str]:
    """`cmd` as the cluster's OS user when this process is root (runuser, util-linux)."""
    return ["runuser", "-u", OS_USER, "--", *cmd] if os.geteuid() == 0 else cmd


def _give_to_owner(path: Path) -> None:
    if os.geteuid() != 0:
        return
    try:
        user = pwd.getpwnam(OS_USER)
    except KeyError:
        raise PostgresMissing(f"PostgreSQL refuses to run as root and there is no '{OS_USER}' user to run it as: "
                              f"{INSTALL_HINT} creates one") from None
    os.chown(path, user.pw_uid, user.pw_gid)


def _run(cmd: list[str], what: str) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed ({out.returncode}): {(out.stderr or out.stdout).strip()[-2000:]}")


@dataclass
class Postgres:
    """A PostgreSQL cluster in `folder`/pg on 127.0.0.1:`port`, created on first start (role, password, database)."""
    folder: Path
    port: int = field(default_factory=free_port)
    bin: Path = field(default_factory=postgres_bin)

    @property
    def data(self) -> Path:
        return self.folder / "pg"

    @property
    def password(self) -> str:
        return (self.folder / "pg-password").read_text().strip()

    @property
    def uri(self) -> str:
        """The backend store URI, without the password (it goes in PGPASSWORD)."""
        return f"postgresql://{DB_ROLE}@127.0.0.1:{self.port}/{DATABASE}"

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if not (self.data / "PG_VERSION").exists():
            self._init()
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories=''"
        _run(_as_owner([str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.folder / "postgres.log"),
                        "-o", options, "-w", "-t", "60", "start"]), f"PostgreSQL in {self.data}")
        self._create_database()

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            _run(_as_owner([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"]),
                 "stopping PostgreSQL")

    def _init(self) -> None:
        secret = self.folder / "pg-password"
        if not secret.exists():
            secret.touch(mode=0o600)
            secret.write_text(secrets.token_urlsafe(24))
        if os.geteuid() == 0 and not self.folder.stat().st_mode & 0o001:
            raise RuntimeError(f"{self.folder} must be traversable by the '{OS_USER}' user (chmod o+x) for "
                               "PostgreSQL, which refuses to run as root")
        self.data.mkdir(mode=0o700, exist_ok=True)
        (self.folder / "postgres.log").touch()
        for path in (self.data, self.folder / "postgres.log", secret):
            _give_to_owner(path)
        _run(_as_owner([str(self.bin / "initdb"), "-D", str(self.data), "-U", DB_ROLE, "--pwfile", str(secret),
                        "--auth=scram-sha-256", "-E", "UTF8", "--no-instructions"]), "initdb")

    def _create_database(self) -> None:
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user=DB_ROLE, password=self.password,
                             dbname="postgres", autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone() is None:
                conn.execute(f"CREATE DATABASE {DATABASE}")


@dataclass
class MlflowServer:
    """`mlflow server` over `backend` (its password in `password`), artifacts proxied into `artifacts`."""
    backend: str
    password: str
    artifacts: Path
    log: Path
    host: str = "127.0.0.1"
    port: int = field(default_factory=free_port)
    workers: int = 1
    allowed_hosts: str | None = None
    proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://{'127.0.0.1' if self.host in ('0.0.0.0', '::') else self.host}:{self.port}"

    def start(self, timeout_s: float = 300) -> None:
        cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.backend, "--serve-artifacts",
               "--artifacts-destination", str(self.artifacts), "--host", self.host, "--port", str(self.port),
               "--workers", str(self.workers)]
        if self.allowed_hosts:
            cmd += ["--allowed-hosts", self.allowed_hosts]
        # job execution (GenAI evaluation jobs) starts seven more processes the workspace never uses
        env = {**os.environ, "PGPASSWORD": self.password, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.artifacts.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._wait_healthy(timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited ({self.proc.returncode}): {self._log_tail()}")
            try:
                if httpx.get(f"{self.uri}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"mlflow server not healthy after {timeout_s:.0f} s: {self._log_tail()}")

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """The server's process group: `sig`, then SIGKILL after 20 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for s in (sig, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, s)
                self.proc.wait(timeout=20)
                return
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                return


@dataclass
class TrackingServer:
    """PostgreSQL and the MLflow server over it, both in `folder`."""
    folder: Path
    host: str = "127.0.0.1"
    port: int = field(default_factory=free_port)
    allowed_hosts: str | None = None
    workers: int = 1
    postgres: Postgres | None = None
    mlflow: MlflowServer | None = None

    @property
    def uri(self) -> str:
        return self.mlflow.uri

    def start(self) -> TrackingServer:
        self.postgres = Postgres(self.folder)
        self.postgres.start()
        self.mlflow = MlflowServer(self.postgres.uri, self.postgres.password, self.folder / "artifacts",
                                   self.folder / "mlflow.log", self.host, self.port, self.workers,
                                   self.allowed_hosts)
        try:
            self.mlflow.start()
        except BaseException:
            self.postgres.stop()
            raise
        return self

    def stop(self) -> None:
        if self.mlflow is not None:
            self.mlflow.stop()
        if self.postgres is not None:
            self.postgres.stop()


def default_allowed_hosts() -> str:
    """MLflow's own (localhost, private addresses) and this machine's names, with and without a port."""
    from mlflow.server.security_utils import get_default_allowed_hosts

    names = {socket.gethostname(), socket.getfqdn()}
    return ",".join([*get_default_allowed_hosts(), *sorted(names), *sorted(f"{n}:*" for n in names)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run the team's MLflow tracking server (PostgreSQL + proxied "
                                             "artifacts) from one folder until interrupted.")
    ap.add_argument("folder", type=Path, help="where the database, the artifacts and the logs live")
    ap.add_argument("--host", default="0.0.0.0", help="address the MLflow server listens on (default: all)")
    ap.add_argument("--port", type=int, default=5000)
    ap.add_argument("--workers", type=int, default=4, help="MLflow server worker processes")
    ap.add_argument("--allowed-hosts", default=None,
                    help="Host headers MLflow accepts (default: localhost, private addresses, this machine's names)")
    args = ap.parse_args(argv)
    server = TrackingServer(args.folder.resolve(), args.host, args.port, args.allowed_hosts or default_allowed_hosts(),
                            args.workers)
    try:
        return serve(server)
    except (PostgresMissing, RuntimeError) as exc:
        print(f"tracking server: {exc}", file=sys.stderr)
        return 2


def serve(server: TrackingServer) -> int:
    """Start `server`, keep it until SIGTERM / Ctrl-C (exit 0) or until the MLflow server dies (exit 1); PostgreSQL
    is stopped either way."""
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        server.start()
        print(f"tracking server {server.uri} (listening on {server.host}:{server.port}), PostgreSQL on "
              f"127.0.0.1:{server.postgres.port}, folder {server.folder}", flush=True)
        while not stopping and server.mlflow.proc.poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        stopping.append(True)
    finally:
        server.stop()
    if stopping:
        return 0
    print(f"the MLflow server exited ({server.mlflow.proc.returncode}); PostgreSQL stopped; log: {server.mlflow.log}",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
