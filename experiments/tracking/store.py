"""The store's building blocks: which SQLite file a URI names, run tags, params and the flattened config, the
prompt set as a dataset. Opening a store and a run is experiments.tracking.runs."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
import time
import warnings
from collections import namedtuple
from collections.abc import Collection
from importlib import metadata
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from experiments.config.paths import ROOT
from experiments.config.views import RunView
from experiments.tracking.redact import redact_params, register_secrets, secrets_of_config

try:
    import mlflow
    from mlflow.entities import Metric, Param
except ImportError:  # a host without MLflow (the H200 host) records into the offline store
    mlflow = None
    Metric = namedtuple("Metric", "key value timestamp step")
    Param = namedtuple("Param", "key value")

PARENT_ENV = "SPECWS_PARENT_RUN_ID"
DATASET_WRITE_TRIES = 4


def sqlite_file(uri: str) -> Path | None:
    """The database file of a `sqlite:///` tracking URI, None for any other store."""
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


# what MLflow accepts in a param name; a mapping with other keys (token strings such as '[BOS]') is data,
# logged whole as one JSON value under its own name
PARAM_NAME = re.compile(r"^[\w.\- :/]+$")


def register_config_secrets(cfg: DictConfig) -> None:
    """Mask the secrets the config holds (secret-named variables, URI passwords, secret flags) in everything this
    process writes from now on; Hydra's own block (a sweep callback's config has it, unresolvable) is left out."""
    plain = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    register_secrets(secrets_of_config(OmegaConf.to_container(plain, resolve=True)))


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


def host_fingerprint(run: RunView) -> str:
    """The machine a baseline was measured on, for the drift check of a stored baseline: host name, CPU count,
    accelerator kind and the engine interpreter (another environment is another engine build)."""
    return f"{platform.node()}/{os.cpu_count()}cpu/{run.site.accelerator}/{run.engine_start.python}"


def run_tags(run: RunView, mode: str, engine: dict[str, str] | None = None) -> dict[str, str]:
    """What a run is and where it ran; `engine` is the engine's own tags (experiments.engines.config.engine_tags)."""
    return (engine or {}) | {
        "specws.option": run.option, "specws.site": run.site.name, "specws.model": run.model.name,
        "specws.workload": run.workload.name, "specws.mode": mode,
        "specws.spec_method": run.spec.method, "git.commit": git_commit(),
        "host.platform": platform.platform(), "host.cpu_count": str(os.cpu_count()),
        "host.accelerator": run.site.accelerator, "specws.host": host_fingerprint(run),
        "versions.mlflow": _version("mlflow"), "versions.hydra": _version("hydra-core"),
        "versions.torch": _version("torch"), "versions.sglang": _version("sglang"),
    }


def measured_digest(rows: list[dict], measured: Collection[str]) -> str:
    """sha256 over the prompts actually sent to be measured: each measured row's id and text, in id order. Two
    workloads drawing different prompts from one prompt set (quick: 24, grounded: all) get different digests."""
    sent = sorted([str(r["id"]), str(r.get("text", ""))] for r in rows if str(r["id"]) in measured)
    canonical = json.dumps(sent, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def log_prompt_dataset(client, run_id: str, name: str, source: str, rows: list[dict], digest: str,
                       measured: Collection[str] | None = None) -> None:
    """The prompts as an MLflow dataset input (shown on the run page, comparable across runs by digest): one row
    per conversation -- id, category, its user turns. With `measured` (the ids sent to be measured), the dataset
    is those prompts and its digest theirs (`measured_digest`; `digest`, the whole prompt set's, is kept as
    `prompt_set_digest`); without, every row under `digest`. Also as `prompt_set.json`, which the offline store
    keeps (no MLflow on the H200 host) and the importer reads (and logs again the same way)."""
    record = {"name": name, "source": source, "digest": digest, "rows": rows}
    if measured is not None:
        ids = {str(i) for i in measured}
        rows = [r for r in rows if str(r["id"]) in ids]
        record |= {"digest": measured_digest(rows, ids), "prompt_set_digest": digest, "measured": sorted(ids)}
        digest = record["digest"]
    client.log_dict(run_id, record, "prompt_set.json")
    if not hasattr(client, "log_inputs"):
        return
    import mlflow.data
    import pandas as pd
    from mlflow.entities import DatasetInput, InputTag

    with warnings.catch_warnings():   # MLflow's notes on ambiguous local sources and integer columns
        warnings.simplefilter("ignore")
        dataset = mlflow.data.from_pandas(pd.DataFrame(rows), source=source, name=name, digest=digest[:36])
        entity = dataset._to_mlflow_entity()
    log_inputs(client, run_id, [DatasetInput(entity, tags=[InputTag("mlflow.data.context", "measured")])])


def log_inputs(client, run_id: str, inputs: list) -> None:
    """`client.log_inputs`, tried again when it lost a race for a dataset's row: MLflow's SQL store looks a dataset
    up and inserts it if missing, so two runs logging the same new prompt set at once (two runners of a team) collide
    on its unique key and the loser's write is rolled back whole; tried again, it finds the winner's row."""
    for attempt in range(1, DATASET_WRITE_TRIES + 1):
        try:
            client.log_inputs(run_id, datasets=inputs)
            return
        except Exception as exc:  # noqa: BLE001 - MlflowException or RestException, by store; re-raised unless a race
            if attempt == DATASET_WRITE_TRIES or not _lost_dataset_race(exc):
                raise
            time.sleep(0.25 * attempt)


def _lost_dataset_race(exc: Exception) -> bool:
    text = str(exc)
    return "UniqueViolation" in text or "UNIQUE constraint failed" in text or "Duplicate entry" in text
