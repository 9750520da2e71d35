"""A tracking client (MlflowClient or OfflineClient) that redacts what it writes (experiments.tracking.redact):
run names, tags, params, dicts, texts, artifact files and dataset inputs. Reads, metrics and everything else are
forwarded unchanged, so a wrapped client has exactly the methods and attributes of the client it wraps."""
from __future__ import annotations

import inspect
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from experiments.tracking.redact import redact_file_text, redact_param, redact_text, redacted_text_of


def redact_data(value: Any) -> Any:
    """A JSON/YAML-like value with every string in it (keys included) redacted."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, Mapping):
        return {redact_data(k) if isinstance(k, str) else k: redact_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_data(v) for v in value]
    return value


def _optional_text(value: Any) -> Any:
    return redact_text(str(value)) if value is not None else None


def _tag_dict(tags: Any) -> Any:
    return {k: redact_text(str(v)) for k, v in tags.items()} if isinstance(tags, Mapping) else tags


def _entities(items: Any, redact: Callable[[str, Any], str]) -> Any:
    """Params or tags of a log_batch (any entity built as Type(key, value)), values redacted."""
    return [type(e)(e.key, redact(e.key, e.value)) for e in items] if items else items


def _datasets(inputs: Any) -> Any:
    """MLflow DatasetInputs with the dataset's name and source redacted."""
    if not inputs:
        return inputs
    from mlflow.entities import Dataset, DatasetInput

    out = []
    for given in inputs:
        d = given.dataset
        dataset = Dataset(name=_optional_text(d.name), digest=d.digest, source_type=d.source_type,
                          source=_optional_text(d.source), schema=d.schema, profile=d.profile)
        out.append(DatasetInput(dataset=dataset, tags=given.tags))
    return out


# method -> argument -> how its value is redacted
_ARGUMENTS: dict[str, dict[str, Callable[[Mapping[str, Any]], Any]]] = {
    "create_run": {"run_name": lambda a: _optional_text(a["run_name"]), "tags": lambda a: _tag_dict(a["tags"])},
    "set_tag": {"value": lambda a: redact_text(str(a["value"]))},
    "log_param": {"value": lambda a: redact_param(a["key"], a["value"])},
    "log_batch": {"params": lambda a: _entities(a["params"], redact_param),
                  "tags": lambda a: _entities(a["tags"], lambda _, v: redact_text(str(v)))},
    "log_dict": {"dictionary": lambda a: redact_data(a["dictionary"])},
    "log_text": {"text": lambda a: redact_file_text(a["text"], str(a.get("artifact_file", "")))},
    "log_inputs": {"datasets": lambda a: _datasets(a["datasets"])},
}


def _redacting(method: Callable, redactors: Mapping[str, Callable]) -> Callable:
    """`method` with the named arguments redacted, however they are passed (the two clients order them
    differently: MlflowClient.create_run(experiment_id, start_time, tags, run_name))."""
    signature = inspect.signature(method)

    def call(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return method(*args, **kwargs)   # let the client itself say what is wrong
        for name, redact in redactors.items():
            if name in bound.arguments:
                bound.arguments[name] = redact(bound.arguments)
        return method(*bound.args, **bound.kwargs)

    call.__name__ = getattr(method, "__name__", "call")
    call.__doc__ = method.__doc__
    return call


class RedactingClient:
    """Wraps `client`; what it writes goes through experiments.tracking.redact."""

    def __init__(self, client: Any) -> None:
        self._client = client

    @property
    def wrapped(self) -> Any:
        return self._client

    def __getattr__(self, name: str) -> Any:
        if name == "_client":   # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        attr = getattr(self._client, name)
        redactors = _ARGUMENTS.get(name)
        return _redacting(attr, redactors) if redactors and callable(attr) else attr

    def __repr__(self) -> str:
        return f"RedactingClient({self._client!r})"

    def log_artifact(self, run_id: str, local_path: str, artifact_path: str | None = None) -> None:
        """A text file holding a secret is logged as a redacted copy of the same name; the file stays as it is."""
        redacted = redacted_text_of(local_path)
        if redacted is None:
            return self._client.log_artifact(run_id, local_path, artifact_path)
        with tempfile.TemporaryDirectory(prefix="redacted-") as tmp:
            copy = Path(tmp) / Path(local_path).name
            copy.write_text(redacted, encoding="utf-8", newline="")
            shutil.copymode(local_path, copy)
            return self._client.log_artifact(run_id, str(copy), artifact_path)

    def log_artifacts(self, run_id: str, local_dir: str, artifact_path: str | None = None) -> None:
        """A folder holding a text file with a secret is logged as a copy with those files redacted (binary files
        copied as they are); the folder stays as it is."""
        files = [p for p in sorted(Path(local_dir).rglob("*")) if p.is_file()]
        redacted = {p.relative_to(local_dir): text for p in files if (text := redacted_text_of(p)) is not None}
        if not redacted:
            return self._client.log_artifacts(run_id, local_dir, artifact_path)
        with tempfile.TemporaryDirectory(prefix="redacted-") as tmp:
            copy = Path(tmp) / Path(local_dir).name
            shutil.copytree(local_dir, copy)
            for rel, text in redacted.items():
                (copy / rel).write_text(text, encoding="utf-8", newline="")
            return self._client.log_artifacts(run_id, str(copy), artifact_path)
