"""The tracking store, checked before anything starts: a local folder or SQLite file that can be written and, for
SQLite, is an MLflow store whose pages SQLite itself finds sound (`PRAGMA quick_check`, bounded in time, on a
read-only connection: a refused file is left as it was); a tracking server that answers an MLflow request within
seconds; the artifact folders the run writes."""
from __future__ import annotations

import base64
import importlib.util
import os
import sqlite3
import tempfile
import time
from pathlib import Path
from urllib.parse import quote, unquote, urlparse

import httpx
from rich.console import Console

from experiments.config.errors import Refused
from experiments.config.views import TrackingView
from experiments.tracking.offline_store import URI_PREFIX
from experiments.tracking.redact import redact_text
from experiments.tracking.store import sqlite_file

console = Console(stderr=True)
TRACKING_TIMEOUT_S = 5.0
SQLITE_HEADER = b"SQLite format 3\x00"
MLFLOW_TABLES = frozenset({"experiments", "runs", "alembic_version"})
# PRAGMA quick_check reads every page: on a big store it is stopped after this long (the pages read so far checked)
QUICK_CHECK_S = 3.0
QUICK_CHECK_STEPS = 10_000   # SQLite virtual-machine steps between two looks at the clock
SQLITE_BUSY_S = 1.0


def check_tracking(tracking: TrackingView) -> None:
    """The store of tracking.uri can be written (a local folder, a SQLite file that is an MLflow store or new) or
    answers within seconds (a server); the artifact folders the run writes can be written."""
    uri, experiment = tracking.uri, tracking.experiment
    shown = redact_text(uri)
    where, fix = f"tracking.uri={shown}", "point tracking.uri at a writable place"
    if uri.startswith(URI_PREFIX):   # the offline store keeps its artifacts in its own folder
        check_writable(Path(uri.removeprefix(URI_PREFIX)), where, fix)
        return
    if uri.startswith(("http://", "https://")):
        _check_tracking_server(uri, shown, experiment)
    elif (db := sqlite_file(uri)) is not None:
        check_writable(db.parent, where, fix)
        if _sqlite_store_has(db, shown, experiment):
            _check_experiment_location(uri, shown, experiment)
    elif uri.startswith("file://"):
        check_writable(Path(uri.split("://", 1)[1]), where, fix)
    elif "://" not in uri:   # a plain folder: MLflow's file store
        check_writable(Path(uri), where, fix)
    if tracking.artifact_root:
        root = Path(tracking.artifact_root)
        check_writable(root, f"tracking.artifact_root={root}", "set tracking.artifact_root to a writable folder")


def check_writable(folder: Path, where: str, fix: str) -> None:
    """The folder exists or can be made, and a file can be created in it: tried, since os.access says yes to
    root and to an immutable folder."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Refused(f"{where}: cannot create the folder {folder} ({exc.strerror or exc}); {fix}") from None
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".specws-write-check-")
    except OSError as exc:
        raise Refused(f"{where}: cannot write in the folder {folder} ({exc.strerror or exc}); {fix}") from None
    os.close(fd)
    os.unlink(probe)


def _sqlite_store_has(db: Path, shown: str, experiment: str) -> bool:
    """Whether the store's SQLite file holds the experiment, read without changing the file. A missing or empty
    file (MLflow creates it) or a database without tables is a new store; a file that is not SQLite, or a
    database with tables but none of MLflow's, is refused."""
    where = f"tracking.uri={shown}"
    fix = "move the file away or point tracking.uri at another file"
    if not db.exists() or (db.is_file() and db.stat().st_size == 0):
        return False
    try:
        with open(db, "rb") as f:
            header = f.read(len(SQLITE_HEADER))
    except OSError as exc:
        raise Refused(f"{where}: cannot read {db} ({exc.strerror or exc}); {fix}") from None
    if header != SQLITE_HEADER:
        raise Refused(f"{where}: {db} is not a SQLite database (no SQLite header); {fix}")
    _quick_check(db, where)
    try:
        tables = _sqlite_tables(db)
        found = "experiments" in tables and _sqlite_has_experiment(db, experiment)
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc):   # another runner is writing: MLflow waits for the lock itself
            return False
        raise Refused(f"{where}: cannot read the SQLite database {db} ({exc}); {fix}") from None
    except sqlite3.DatabaseError as exc:
        raise Refused(f"{where}: {db} is a damaged SQLite database ({exc}); {fix}") from None
    if tables and not tables & MLFLOW_TABLES:
        raise Refused(f"{where}: {db} is a SQLite database but not an MLflow store (its tables: "
                      f"{', '.join(sorted(tables)[:5])}); {fix}")
    return found


def _read_only(db: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{quote(str(db))}?mode=ro", uri=True, timeout=SQLITE_BUSY_S)


def _quick_check(db: Path, where: str) -> None:
    """SQLite's own check of every page (`PRAGMA quick_check`), read-only, stopped after QUICK_CHECK_S on a big
    store; a damaged page is refused naming the file, which is left as it was."""
    con = _read_only(db)
    deadline = time.monotonic() + QUICK_CHECK_S
    con.set_progress_handler(lambda: time.monotonic() > deadline, QUICK_CHECK_STEPS)
    try:
        found = [row[0] for row in con.execute("PRAGMA quick_check(5)").fetchall()]
    except sqlite3.OperationalError as exc:
        if "interrupted" in str(exc):
            console.print(f"[yellow]{db}: PRAGMA quick_check stopped after {QUICK_CHECK_S:g} s[/] (a big store); "
                          "its pages are checked only in part")
            return
        if "locked" in str(exc):   # another runner is writing: MLflow waits for the lock itself
            return
        found = [str(exc)]
    except sqlite3.DatabaseError as exc:
        found = [str(exc)]
    finally:
        con.close()
    if found != ["ok"]:
        raise Refused(f"{where}: {db} is a damaged SQLite database (PRAGMA quick_check: {'; '.join(found)}); the "
                      f"file was not changed: restore it from a backup, or recover what SQLite can read "
                      f"(`sqlite3 {db} .recover | sqlite3 recovered.db`), or point tracking.uri at another file")


def _sqlite_tables(db: Path) -> set[str]:
    con = _read_only(db)
    try:
        return {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        con.close()


def _sqlite_has_experiment(db: Path, experiment: str) -> bool:
    con = _read_only(db)
    try:
        return con.execute("SELECT 1 FROM experiments WHERE name = ?", (experiment,)).fetchone() is not None
    finally:
        con.close()


def _check_experiment_location(uri: str, shown: str, experiment: str) -> None:
    """An experiment that exists keeps its artifact location (fixed when it was created): a local one must be
    writable, whatever tracking.artifact_root says now."""
    if importlib.util.find_spec("mlflow") is None:   # the store's setup says what to use instead
        return
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        exp = MlflowClient(tracking_uri=uri).get_experiment_by_name(experiment)
    except MlflowException as exc:
        raise Refused(f"tracking.uri={shown}: MLflow cannot open the store ({str(exc).splitlines()[0]}); "
                      "upgrade it with `mlflow db upgrade` or point tracking.uri at another file") from None
    folder = _local_folder(exp.artifact_location) if exp is not None else None
    if folder is not None:
        check_writable(folder, f"the artifact location of experiment {experiment} (store tracking.uri={shown})",
                        "set tracking.experiment to a new name (its artifacts then go under tracking.artifact_root) "
                        "or make the folder writable")


def _local_folder(location: str | None) -> Path | None:
    """The folder of a `file://` URI or a plain path; None for a remote location."""
    if not location:
        return None
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    return None if parsed.scheme else Path(location)


def _check_tracking_server(uri: str, shown: str, experiment: str) -> None:
    """The server answers an MLflow request (the experiment looked up by name) within seconds: a server whose own
    store fails answers 5xx, refused as well as one that does not answer."""
    try:
        reply = httpx.get(uri.rstrip("/") + "/api/2.0/mlflow/experiments/get-by-name",
                          params={"experiment_name": experiment}, headers=_mlflow_auth(),
                          timeout=TRACKING_TIMEOUT_S, follow_redirects=True)
    except httpx.HTTPError as exc:
        raise Refused(f"tracking.uri={shown}: no answer within {TRACKING_TIMEOUT_S:.0f} s ({type(exc).__name__}: "
                      f"{redact_text(str(exc))}); start the tracking server or set tracking.uri") from None
    if reply.status_code in (401, 403):
        raise Refused(f"tracking.uri={shown}: the server refused access (HTTP {reply.status_code}); set "
                      "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN")
    if reply.status_code >= 500:
        raise Refused(f"tracking.uri={shown}: the tracking server answers but cannot read its store (HTTP "
                      f"{reply.status_code}: {redact_text(reply.text.strip()[:300])}); fix the server's backend store")


def _mlflow_auth() -> dict[str, str]:
    """MLflow's own credentials variables as the client sends them (a URI's user:password goes by itself)."""
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    if token:
        return {"Authorization": f"Bearer {token}"}
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if not user:
        return {}
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password or ''}".encode()).decode()}
