"""A stored run's configuration, read once from its flattened params (and tags) into typed fields; the analysis
reads these fields, and asks the run's engine's rules (experiments/engines/speculation.py) what they imply.

Params are the resolved config flattened by experiments/tracking/store.py `flatten`: every value `str()`-ed, so
null is "None" and a list is its Python repr."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from experiments.config.views import SpecView
from experiments.engines.speculation import NgramWindow, Speculation, speculation_of

NGRAM_KEYS = ("min_match", "max_match", "min_bfs_breadth", "max_bfs_breadth", "max_trie_depth")
SLO_LATENCIES = ("ttft", "tpot", "e2e")     # workload.slo.<name>_p99_s


def _int(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:   # "None" (a null), or text that is no number
        return None


def _list(value: str | None) -> list:
    """A list param; a value that does not parse reads as empty."""
    if not value:
        return []
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return []
    return list(parsed) if isinstance(parsed, list | tuple) else [parsed]


def _text(value: str | None) -> str | None:
    return None if value in (None, "None") else value


def _float(value: str | None) -> float | None:
    try:
        return None if value is None else float(value)
    except ValueError:   # "None"
        return None


def _slo(params: dict[str, str]) -> tuple[tuple[str, float], ...]:
    found = ((name, _float(params.get(f"workload.slo.{name}_p99_s"))) for name in SLO_LATENCIES)
    return tuple((name, value) for name, value in found if value is not None)


def prompt_set_label(value: str | None) -> str | None:
    """A prompt set as a reader knows it: a built-in name (or names) as given, a file of one's own by its name."""
    if value is None:
        return None
    return ",".join(part.rsplit("/", 1)[-1] for part in value.split(","))


@dataclass(frozen=True)
class RunConfig:
    """What a measured run ran: engine, speculation, model length, engine arguments, load and limits."""
    engine: str                          # "?" when the run names none
    spec: SpecView
    option: str | None = None
    workload: str | None = None
    max_model_len: int | None = None
    engine_args: tuple[str, ...] = ()    # the site's arguments for the engine, then engine.extra_args
    concurrency: tuple[int, ...] = ()
    max_running_requests: int | None = None
    baseline_run_id: str | None = None
    prompt_set: str | None = None        # the workload's prompt set (a file by its name)
    arrival: str = "closed"              # closed loop, or the open-loop process (poisson, gamma) at `rate` req/s
    rate: float | None = None
    slo: tuple[tuple[str, float], ...] = ()   # (latency, target seconds) for the workload's targets that are set

    @property
    def closed(self) -> bool:
        return self.arrival == "closed"

    @property
    def slo_targets(self) -> dict[str, float]:
        return dict(self.slo)

    @classmethod
    def from_params(cls, params: dict[str, str], tags: dict[str, str] | None = None) -> RunConfig:
        tags = tags or {}
        engine = tags.get("specws.engine") or params.get("engine.name") or "?"
        spec = SpecView(method=params.get("spec.method", "none"), num_steps=_int(params.get("spec.num_steps")),
                        topk=_int(params.get("spec.topk")), num_draft_tokens=_int(params.get("spec.num_draft_tokens")),
                        draft_model=_text(params.get("spec.draft_model")),
                        moe_expert_budget=_int(params.get("spec.moe_expert_budget")),
                        ngram={k: _int(params.get(f"spec.ngram.{k}")) for k in NGRAM_KEYS})
        args = _list(params.get(f"site.engine_args.{engine}")) + _list(params.get("engine.extra_args"))
        return cls(engine, spec, tags.get("specws.option"), tags.get("specws.workload"),
                   _int(params.get("model.max_model_len")), tuple(str(a) for a in args),
                   tuple(c for c in map(_int, map(str, _list(params.get("workload.concurrency")))) if c),
                   _int(params.get("limits.max_running_requests")), tags.get("specws.baseline_run_id"),
                   prompt_set_label(_text(params.get("workload.prompt_set"))),
                   _text(params.get("workload.arrival")) or "closed", _float(params.get("workload.rate")),
                   _slo(params))

    @property
    def speculation(self) -> Speculation:
        return speculation_of(self.engine)

    @property
    def fixed_verify_width(self) -> bool:
        """The engine verifies a fixed number of tokens per step (so its step times fit across runs)."""
        return self.speculation.fixed_verify_width

    @property
    def verified_per_step(self) -> float | None:
        return self.speculation.verified_per_step(self.spec)

    def ngram_window(self) -> NgramWindow | None:
        """See Speculation.ngram_window (raises ValueError for a setting the run left unset)."""
        return self.speculation.ngram_window(self.spec)

    @property
    def graph_batch_limit(self) -> int | None:
        return self.speculation.graph_batch_limit(list(self.engine_args))


def run_config(run: Any) -> RunConfig:
    """The configuration of an MLflow (or offline-store) run."""
    return RunConfig.from_params(run.data.params, run.data.tags)
