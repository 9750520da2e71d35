"""The runs a report (or a recommendation) is made of: the speculative runs of an experiment or a sweep with their
paired baselines, their records downloaded once, their configuration labels, the contamination check, and the
records of several runs pooled as prompts (each run's prompt paired with its own baseline's)."""
from __future__ import annotations

import argparse
from datetime import UTC, datetime

from experiments.analysis.categories import accept_length_of, acceptor
from experiments.analysis.contamination import check_contamination
from experiments.analysis.runs import run_config
from experiments.analysis.words import config_words
from experiments.tracking.records import run_records

CONTAMINATED = "contaminated — not a verdict"


class ReportInputError(ValueError):
    """Nothing to report on; nothing was written."""


def since_ms(text: str) -> int:
    try:
        t = datetime.fromisoformat(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an ISO time: {text!r} (e.g. 2026-11-30T21:00)") from exc
    return int((t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp() * 1000)


def add_target(ap: argparse.ArgumentParser) -> None:
    """The experiment (or a sweep's parent run) to read, given either way: positionally or as --experiment."""
    ap.add_argument("target", nargs="?", help="experiment name or parent (sweep) run id")
    ap.add_argument("--experiment", help="the same, as an option (either form; not both with different values)")


def target_of(ap: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The target given to `add_target`'s arguments; exits through `ap.error` when none or two different ones."""
    given = {t for t in (args.target, args.experiment) if t}
    if len(given) != 1:
        ap.error("give one experiment name or parent run id (positionally or as --experiment)" if not given
                 else f"two different targets given: {' and '.join(sorted(given))}")
    return given.pop()


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%MZ")


def config_key(run) -> tuple[str, str]:
    """(the run's configuration in words, its workload): what the report groups runs by and shows."""
    config = run_config(run)
    return config_words(config), config.workload or "?"


def records_of(client, run_id: str) -> list[dict]:
    """A run's records; none for a run without them (it gets no request-level interval)."""
    return run_records(client, run_id) or []


def _lookup_errors() -> tuple[type[Exception], ...]:
    """What a store raises for a run it does not have: MLflow's error, the offline store's (a host without MLflow)."""
    try:
        from mlflow.exceptions import MlflowException
    except ImportError:
        return (OSError, KeyError)
    return (MlflowException, OSError, KeyError)


def select_runs(client, target: str, since_ms: int | None = None) -> tuple[list, list, str, object | None]:
    """(speculative runs, all runs by which baselines are found, experiment id, parent run or None); with
    `since_ms`, only speculative runs started then or later (e.g. one lease of a GPU host)."""
    exp = client.get_experiment_by_name(target)
    parent = None
    if exp is None:
        try:
            parent = client.get_run(target)
        except _lookup_errors() as exc:
            raise ReportInputError(f"{target!r} is neither an experiment nor a run in {client.tracking_uri}") from exc
        exp_id = parent.info.experiment_id
    else:
        exp_id = exp.experiment_id
    runs = client.search_runs([exp_id], "attributes.status = 'FINISHED' and tags.`specws.mode` = 'measure'",
                              max_results=5000)
    chosen = [r for r in runs if (parent is None or r.data.tags.get("mlflow.parentRunId") == parent.info.run_id)
              and (since_ms is None or r.info.start_time >= since_ms)]
    options = [r for r in chosen if run_config(r).spec.speculative and r.data.tags.get("specws.baseline_run_id")]
    if not options:
        since = "" if since_ms is None else f" started since {iso(since_ms)}"
        raise ReportInputError(f"{target}: no finished speculative run with a paired baseline{since} to report on")
    return options, runs, exp_id, parent


class Records:
    """Each run's records, downloaded once."""

    def __init__(self, client) -> None:
        self.client, self.cache = client, {}

    def __call__(self, run_id: str) -> list[dict]:
        if run_id not in self.cache:
            self.cache[run_id] = records_of(self.client, run_id)
        return self.cache[run_id]


def run_acceptor(run):
    """The run's engine's per-request acceptance; an engine the workspace does not know reports none."""
    try:
        return acceptor(run_config(run).engine)
    except ValueError:
        return lambda record: None


def contamination_of(run, records: list[dict]) -> str:
    """The run's logged check (specws.contamination), else the check computed now from its records."""
    if tag := run.data.tags.get("specws.contamination"):
        return tag
    return check_contamination(records, accept_length_of(run_acceptor(run))).as_tag()


def pooled_records(runs: list, records: Records) -> tuple[list[dict], list[dict]]:
    """Every run's records and its baseline's, prompt ids prefixed by the pair, so that pairs pool as prompts."""
    opt, base = [], []
    for i, run in enumerate(runs):
        for out, rid in ((opt, run.info.run_id), (base, run.data.tags["specws.baseline_run_id"])):
            out.extend({**r, "prompt_id": f"{i}/{r['prompt_id']}"} for r in records(rid))
    return opt, base
