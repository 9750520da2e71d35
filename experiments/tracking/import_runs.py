"""`python -m experiments.tracking.import_runs <offline store folder, .tar.gz or .tar.xz> [--tracking-uri URI]`:
log runs recorded on a host without MLflow (experiments.tracking.offline_store) into the workspace's MLflow store.

Runs keep their experiment name, status, times, params, tags, full metric history and artifacts; links
between them (parent run, paired baseline, training run) are rewritten to the new run ids, and each gets
`specws.imported_from` = its offline id, so importing the same folder twice is refused run by run.
"""
from __future__ import annotations

import argparse
import json
import os
import tarfile
import tempfile
from pathlib import Path

import mlflow
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from experiments.config.paths import ROOT
from experiments.tracking.lifecycle import tracked_run
from experiments.tracking.offline_store import OfflineClient
from experiments.tracking.redact import register_secrets, secrets_of_environ
from experiments.tracking.redacting import RedactingClient
from experiments.tracking.store import log_prompt_dataset, sqlite_file

LINK_TAGS = ("mlflow.parentRunId", "specws.baseline_run_id", "specws.paired_option_run_id", "specws.training_run_id",
             "specws.evaluation_run_id", "specws.source_run_id")
DEFAULT_URI = f"sqlite:///{ROOT / 'mlruns' / 'mlflow.db'}"
# a lease writes its store as <stem>.tar.gz; the journal keeps it re-packed as <stem>.tar.xz (same tar inside)
ARCHIVE_SUFFIXES = (".tar.xz", ".tar.gz")


def import_store(source: OfflineClient, client: MlflowClient, artifact_root: Path | None = None) -> dict[str, str]:
    """Offline run id -> new MLflow run id, for every run not imported before."""
    mapping: dict[str, str] = {}
    for old_id in source.run_ids():
        meta = source.meta(old_id)
        exp_id = experiment_for(client, meta["experiment"], artifact_root)
        done = client.search_runs([exp_id], filter_string=f"tags.`specws.imported_from` = '{old_id}'")
        if done:
            mapping[old_id] = done[0].info.run_id
            print(f"already imported: {meta['run_name']} ({old_id}) -> {mapping[old_id]}")
            continue
        tags = {k: mapping.get(v, v) if k in LINK_TAGS else v for k, v in meta["tags"].items()}
        new_id, status = _import_run(source, client, exp_id, old_id, meta, tags)
        mapping[old_id] = new_id
        print(f"imported {meta['experiment']} / {meta['run_name']} [{status}] -> {new_id}")
    for old_id, new_id in mapping.items():  # links to runs created later (a parent's evaluation, ...)
        for key, value in source.meta(old_id)["tags"].items():
            if key in LINK_TAGS and value in mapping and key != "mlflow.parentRunId":
                client.set_tag(new_id, key, mapping[value])
    return mapping


def _import_run(source: OfflineClient, client: MlflowClient, exp_id: str, old_id: str, meta: dict,
                tags: dict[str, str]) -> tuple[str, str]:
    """One run, all or nothing: `specws.imported_from` (what a re-import looks for) is set last, and a run that
    fails half-way is deleted, so that the next import starts it again."""
    status = meta["status"] if meta["status"] != "RUNNING" else "FAILED"  # never finished over there
    params = {k: str(v) for k, v in meta["params"].items()}
    run = None
    try:
        with tracked_run(client, exp_id, meta["run_name"], tags, params, start_time=meta["start_time"],
                         system_metrics=False) as run:
            metrics = [Metric(r["key"], r["value"], r["timestamp"], r["step"]) for r in source.metric_rows(old_id)]
            for i in range(0, len(metrics), 1000):
                client.log_batch(run.id, metrics=metrics[i:i + 1000])
            artifacts = source.root / old_id / "artifacts"
            if any(artifacts.iterdir()):
                client.log_artifacts(run.id, str(artifacts))
            prompt_set = artifacts / "prompt_set.json"
            if prompt_set.exists():   # the dataset input the offline store could not hold
                ps = json.loads(prompt_set.read_text())
                log_prompt_dataset(client, run.id, ps["name"], ps["source"], ps["rows"],
                                   ps.get("prompt_set_digest", ps["digest"]), ps.get("measured"))
            client.set_tag(run.id, "specws.imported_from", old_id)
            run.finish_as(status, meta["tags"].get("specws.failure", ""), end_time=meta["end_time"])
    except Exception:
        if run is not None:
            client.delete_run(run.id)
        raise
    return run.id, status


def experiment_for(client: MlflowClient, name: str, artifact_root: Path | None) -> str:
    """The experiment's id, created with its artifacts under `artifact_root` (default_artifact_root) if missing."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = (artifact_root / name.replace("/", "_")).as_uri() if artifact_root else None
    return client.create_experiment(name, artifact_location=location)


RUN_KEYS = ("run_id", "experiment", "run_name", "status", "start_time", "end_time", "params", "tags")


class SourceRefused(SystemExit):
    """An offline store (folder or archive) that is not imported; the message names the file and why."""


def offline_folder(source: Path, tmp: Path) -> Path:
    """The one offline store inside `source`, a folder or a .tar.gz / .tar.xz of one (unpacked into `tmp`), checked the
    same way for both: what tarfile's `data` filter refuses in an archive (links leading out of it, device
    files) is refused in a folder too, and every run.json must be a run."""
    if not source.exists():
        raise SourceRefused(f"no such folder or archive: {source}")
    top = source
    if source.is_file():
        try:
            with tarfile.open(source) as tar:
                tar.extractall(tmp, filter="data")
        except (tarfile.TarError, OSError) as exc:
            raise SourceRefused(f"{source}: refused ({type(exc).__name__}: {exc})") from None
        top = Path(tmp)
    _refuse_unsafe_entries(top, source)
    found = {p.parent.parent for p in top.rglob("run.json")}
    roots = sorted(r for r in found if not any(r.is_relative_to(other) and r != other for other in found))
    if not roots:
        raise SourceRefused(f"{source} holds no offline runs (no */run.json)")
    if len(roots) > 1:
        names = ", ".join(str(r.relative_to(top)) or "." for r in roots)
        raise SourceRefused(f"{source} holds {len(roots)} offline stores ({names}): give one of them")
    for meta_path in roots[0].glob("*/run.json"):
        _check_run_json(meta_path, meta_path.relative_to(top) if source.is_file() else meta_path)
    return roots[0]


def archive_stem(path: Path) -> str | None:
    """`runs` of `runs.tar.xz` or `runs.tar.gz`; None for any other name."""
    for suffix in ARCHIVE_SUFFIXES:
        if path.name.endswith(suffix) and len(path.name) > len(suffix):
            return path.name[: -len(suffix)]
    return None


def store_archive(folder: Path, stem: str = "runs") -> Path:
    """A lease's store in `folder`: `<stem>.tar.xz`, else `<stem>.tar.gz`."""
    for suffix in ARCHIVE_SUFFIXES:
        path = folder / f"{stem}{suffix}"
        if path.is_file():
            return path
    raise FileNotFoundError(f"no {' or '.join(stem + s for s in ARCHIVE_SUFFIXES)} in {folder}")


def _refuse_unsafe_entries(top: Path, source: Path) -> None:
    resolved_top = top.resolve()
    for path in top.rglob("*"):
        where = path.relative_to(top)
        if path.is_symlink():
            target = path.resolve()
            if not target.is_relative_to(resolved_top):
                raise SourceRefused(f"{source}: {where} is a link to {target}, outside the store: refused")
        elif not (path.is_file() or path.is_dir()):
            raise SourceRefused(f"{source}: {where} is not a regular file or folder: refused")


def _check_run_json(path: Path, shown: Path) -> None:
    try:
        meta = json.loads(path.read_text())
    except (ValueError, OSError) as exc:
        raise SourceRefused(f"{shown}: not a run record ({type(exc).__name__}: {exc})") from None
    missing = [k for k in RUN_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise SourceRefused(f"{shown}: not a run record (missing {', '.join(missing)})")
    if meta["run_id"] != path.parent.name:
        raise SourceRefused(f"{shown}: run_id {meta['run_id']!r} is not its folder's name {path.parent.name!r}")


def default_artifact_root(uri: str) -> Path | None:
    """Where imported runs' artifacts go by default: `<database folder>/artifacts` for a SQLite store (the layout of
    the workspace's own store, conf/tracking/local.yaml), None (the server's own) for a tracking server, the
    workspace's mlruns/artifacts for any other store (never the current directory)."""
    if uri.startswith(("http://", "https://")):
        return None
    db = sqlite_file(uri)
    return db.resolve().parent / "artifacts" if db is not None else ROOT / "mlruns" / "artifacts"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("source", type=Path, help="offline store folder, or a .tar.gz / .tar.xz of one")
    parser.add_argument("--tracking-uri", default=DEFAULT_URI)
    parser.add_argument("--artifact-root", type=Path, default=None,
                        help="where a new experiment keeps its artifacts (default: `artifacts` beside a SQLite "
                             "store's database file, as the workspace's own store keeps them; a tracking server's "
                             "own, proxied, for an http(s) URI; mlruns/artifacts for any other store)")
    args = parser.parse_args(argv)
    if args.artifact_root is None:
        args.artifact_root = default_artifact_root(args.tracking_uri)
    with tempfile.TemporaryDirectory() as tmp:
        folder = offline_folder(args.source, Path(tmp))
        mlflow.set_tracking_uri(args.tracking_uri)
        register_secrets(secrets_of_environ(os.environ))   # a folder written before redaction existed, too
        mapping = import_store(OfflineClient(folder), RedactingClient(MlflowClient()), args.artifact_root)
    print(f"{len(mapping)} runs in {args.tracking_uri}")


if __name__ == "__main__":
    main()
