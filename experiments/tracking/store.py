"""MLflow store setup, run tags and the flattened config."""
from __future__ import annotations

import fcntl
import json
import os
import platform
import re
import subprocess
import warnings
from collections import namedtuple
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from experiments.config.paths import ROOT
from experiments.tracking.offline_store import URI_PREFIX, OfflineClient
from experiments.tracking.redact import redact_params, register_secrets, secrets_of_config, secrets_of_environ
from experiments.tracking.redacting import RedactingClient

try:
    import mlflow
    from mlflow.entities import Metric, Param
except ImportError:  # a host without MLflow (the H200 host) records into the offline store
    mlflow = None
    Metric = namedtuple("Metric", "key value timestamp step")
    Param = namedtuple("Param", "key value")

PARENT_ENV = "SPECWS_PARENT_RUN_ID"


def sqlite_file(uri: str) -> Path | None:
    """The database file of a `sqlite:///` tracking URI, None for any other store."""
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


@contextmanager
def _store_lock(uri: str):
    """Serialise first use of a SQLite store: MLflow creates its schema on first contact, and two
    processes doing that at once fail with 'table ... already exists'."""
    db = sqlite_file(uri)
    if db is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def setup(cfg: DictConfig) -> tuple[Any, str]:
    """Point MLflow at the configured store; the experiment is created with its artifact folder.
    An `offline://<folder>` URI records into plain files instead (experiments.tracking.offline_store).
    The client redacts what it writes: the secrets of the config and of this process's environment included."""
    plain = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])   # a sweep callback's has it, unresolvable
    register_secrets(secrets_of_config(OmegaConf.to_container(plain, resolve=True)) | secrets_of_environ(os.environ))
    if str(cfg.tracking.uri).startswith(URI_PREFIX):
        client = RedactingClient(OfflineClient(str(cfg.tracking.uri).removeprefix(URI_PREFIX)))
        _fail_stale_once(client, str(cfg.tracking.uri), cfg.tracking.experiment)
        return client, cfg.tracking.experiment
    if mlflow is None:
        raise RuntimeError(f"MLflow is not installed here; use tracking.uri={URI_PREFIX}<folder> and import the "
                           "runs elsewhere with `python -m experiments.tracking.import_runs <folder>`")
    mlflow.set_tracking_uri(cfg.tracking.uri)
    from mlflow.tracking import MlflowClient

    with _store_lock(cfg.tracking.uri):
        client = RedactingClient(MlflowClient())
        exp_id = _experiment_id(client, cfg)
    _fail_stale_once(client, str(cfg.tracking.uri), exp_id)
    return client, exp_id


_checked_for_stale: set[tuple[str, str]] = set()


def _fail_stale_once(client, uri: str, experiment_id: str) -> None:
    """At a runner's first contact with an experiment: the ends a failing store could not take are recorded,
    then runs left RUNNING by a runner that is gone become FAILED."""
    if (uri, experiment_id) in _checked_for_stale:
        return
    _checked_for_stale.add((uri, experiment_id))
    from experiments.tracking.lifecycle import apply_pending_ends, fail_stale_runs
    if not uri.startswith(URI_PREFIX):
        apply_pending_ends(client)   # first: a run with a kept end is not a stale one
    fail_stale_runs(client, experiment_id)


def _experiment_id(client, cfg: DictConfig) -> str:
    name = cfg.tracking.experiment
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if cfg.tracking.artifact_root:
        root = Path(cfg.tracking.artifact_root)
        root.mkdir(parents=True, exist_ok=True)
        location = (root / name.replace("/", "_")).as_uri()
    return client.create_experiment(name, artifact_location=location)


# what MLflow accepts in a param name; a mapping with other keys (token strings such as '[BOS]') is data,
# logged whole as one JSON value under its own name
PARAM_NAME = re.compile(r"^[\w.\- :/]+$")


def flatten(cfg: DictConfig) -> dict[str, str]:
    out: dict[str, str] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict) and node and not all(PARAM_NAME.match(str(k)) for k in node):
            out[prefix] = json.dumps(node)[:6000]
        elif isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            out[prefix] = str(node)[:6000]

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


def log_params(client, run_id: str, params: dict[str, str]) -> None:
    """Params in batches of 100 (MLflow's limit per call), secrets redacted (experiments.tracking.redact)."""
    items = list(redact_params(params).items())
    for start in range(0, len(items), 100):
        client.log_batch(run_id, params=[Param(k, v) for k, v in items[start: start + 100]])


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def host_fingerprint(cfg: DictConfig) -> str:
    """The machine a baseline was measured on, for the drift check of a stored baseline: host name, CPU count,
    accelerator kind and the engine interpreter (another environment is another engine build)."""
    return f"{platform.node()}/{os.cpu_count()}cpu/{cfg.site.accelerator}/{cfg.engine.python}"


def run_tags(cfg: DictConfig, mode: str, engine: dict[str, str]) -> dict[str, str]:
    """What a run is and where it ran; `engine` is the engine's own tags (experiments.engines.config.engine_tags)."""
    return engine | {
        "specws.option": cfg.option.name, "specws.site": cfg.site.name, "specws.model": cfg.model.name,
        "specws.workload": cfg.workload.name, "specws.mode": mode,
        "specws.spec_method": cfg.spec.method, "git.commit": git_commit(),
        "host.platform": platform.platform(), "host.cpu_count": str(os.cpu_count()),
        "host.accelerator": cfg.site.accelerator, "specws.host": host_fingerprint(cfg),
        "versions.mlflow": _version("mlflow"), "versions.hydra": _version("hydra-core"),
        "versions.torch": _version("torch"), "versions.sglang": _version("sglang"),
    }


def log_prompt_dataset(client, run_id: str, name: str, source: str, rows: list[dict], digest: str) -> None:
    """The prompt set as an MLflow dataset input (shown on the run page, comparable across runs by digest):
    one row per conversation -- id, category, its user turns -- with the workspace's own content digest. Also
    as `prompt_set.json`, which the offline store keeps (no MLflow on the H200 host) and the importer reads."""
    client.log_dict(run_id, {"name": name, "source": source, "digest": digest, "rows": rows}, "prompt_set.json")
    if not hasattr(client, "log_inputs"):
        return
    import mlflow.data
    import pandas as pd
    from mlflow.entities import DatasetInput, InputTag

    with warnings.catch_warnings():   # MLflow's notes on ambiguous local sources and integer columns
        warnings.simplefilter("ignore")
        dataset = mlflow.data.from_pandas(pd.DataFrame(rows), source=source, name=name, digest=digest[:36])
        entity = dataset._to_mlflow_entity()
    client.log_inputs(run_id, datasets=[DatasetInput(entity, tags=[InputTag("mlflow.data.context", "measured")])])
