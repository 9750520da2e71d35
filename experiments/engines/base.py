"""What every engine adapter provides: flags from config, validation by the engine's own parser,
the streaming request it understands, and the acceptance it reports."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from experiments.config.views import LaunchView, LimitsView, ModelView, SpecView

TOPK = 5  # log-probabilities asked for at a greedy divergence (bf16 often ties three ways)


class InvalidLaunch(RuntimeError):
    """The engine's own parser refused the command line; the message is the engine's."""


@dataclass
class Validation:
    ok: bool
    version: str
    error: str | None = None
    limits: dict = field(default_factory=dict)   # effective limits the engine's own config resolved (vLLM)


@dataclass
class RequestAcceptance:
    """Speculation of one request, for per-prompt and per-category analysis.

    `steps`: engine steps that emitted tokens for the request, `emitted`: tokens they emitted,
    `proposed`: draft tokens proposed (None where the engine does not say), `accepted_per_position[i]`:
    steps that accepted draft position i (None where the engine does not say). Each engine's docstring
    of `request_acceptance` says exactly what it counts as a step."""
    steps: int
    emitted: int
    proposed: int | None = None
    accepted_per_position: list[int] | None = None
    correct_drafts: int | None = None   # accepted draft tokens, where the engine counts them itself

    @property
    def accept_length(self) -> float:
        return self.emitted / self.steps if self.steps else float("nan")

    @property
    def accepted(self) -> int:
        """Accepted draft tokens: the engine's count, else the per-position counts, else tokens beyond one
        per step."""
        if self.correct_drafts is not None:
            return self.correct_drafts
        if self.accepted_per_position is not None:
            return sum(self.accepted_per_position)
        return max(0, self.emitted - self.steps)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else float("nan")


def accepted_per_position(steps_accepting: dict[int, int]) -> list[int]:
    """{accepted drafts n: steps that accepted n} -> steps that accepted position i, i = 0..max n - 1
    (drafts are accepted in order, so a step accepting n drafts accepted positions 0..n-1)."""
    width = max((n for n, c in steps_accepting.items() if c), default=0)
    return [sum(c for n, c in steps_accepting.items() if n > i) for i in range(width)]


class StreamError(ValueError):
    """A streamed reply the request fails on; `kind` is its record's `error_kind` (error_event, null_event,
    bad_json, ...)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def checked_event(event: object) -> dict:
    """`event` if it is a stream event, else StreamError: `null` (null_event), not a JSON object (bad_json), or
    the engine's error event (error_event: vLLM's and SGLang's `{"error": ...}`, vLLM's `{"object": "error"}`)."""
    if event is None:
        raise StreamError("null_event", "the server sent a `null` event")
    if not isinstance(event, dict):
        raise StreamError("bad_json", f"event is not a JSON object: {str(event)[:200]}")
    if "error" in event or event.get("object") == "error":
        detail = event.get("error", event)
        message = detail.get("message", detail) if isinstance(detail, dict) else detail
        raise StreamError("error_event", f"the server sent an error event: {str(message)[:300]}")
    return event


@dataclass
class StreamDelta:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    meta: dict | None = None     # per-request engine metadata (SGLang meta_info)


@dataclass
class Acceptance:
    """Speculation as the engine reported it over a measured window."""
    drafts: int                  # verification steps that carried a draft
    draft_tokens: int
    accepted_tokens: int
    per_position: list[float]    # P(draft token i accepted), i = 0..k-1
    accept_length: float         # tokens emitted per verification step, bonus token included
    acceptance_rate: float       # accepted / proposed draft tokens
    length_histogram: dict[int, float] = field(default_factory=dict)  # P(step emits n tokens)

    def as_metrics(self, prefix: str = "") -> dict[str, float]:
        out = {f"{prefix}accept_length": self.accept_length, f"{prefix}acceptance_rate": self.acceptance_rate,
               f"{prefix}spec_drafts": self.drafts, f"{prefix}spec_draft_tokens": self.draft_tokens,
               f"{prefix}spec_accepted_tokens": self.accepted_tokens}
        out.update({f"{prefix}accept_pos_{i}": p for i, p in enumerate(self.per_position)})
        return out


def acceptance_from_positions(drafts: int, draft_tokens: int, accepted: int,
                              per_pos_counts: list[float]) -> Acceptance | None:
    """Counters of accepted tokens per draft position also give the accept-length distribution:
    positions are accepted in order, so #steps accepting >= i tokens = count at position i-1."""
    if drafts <= 0:
        return None
    at_least = [float(drafts), *per_pos_counts]
    hist = {n + 1: (at_least[n] - (at_least[n + 1] if n + 1 < len(at_least) else 0.0)) / drafts
            for n in range(len(at_least))}
    return Acceptance(drafts=drafts, draft_tokens=draft_tokens, accepted_tokens=accepted,
                      per_position=[c / drafts for c in per_pos_counts],
                      accept_length=1.0 + accepted / drafts,
                      acceptance_rate=accepted / draft_tokens if draft_tokens else 0.0,
                      length_histogram=hist)


def merge_acceptance(parts: list[Acceptance]) -> Acceptance | None:
    """One window's acceptance from several (the concurrency levels), weighted by their steps: the run's
    figure excludes what happened between levels (the per-level warm-up batches)."""
    parts = [a for a in parts if a is not None and a.drafts > 0]
    if not parts:
        return None
    drafts = sum(a.drafts for a in parts)
    draft_tokens, accepted = sum(a.draft_tokens for a in parts), sum(a.accepted_tokens for a in parts)
    width = max(len(a.per_position) for a in parts)
    per_pos = [sum(a.drafts * (a.per_position[i] if i < len(a.per_position) else 0.0) for a in parts) / drafts
               for i in range(width)]
    hist: dict[int, float] = {}
    for a in parts:
        for n, p in a.length_histogram.items():
            hist[n] = hist.get(n, 0.0) + a.drafts * p / drafts
    return Acceptance(drafts=drafts, draft_tokens=draft_tokens, accepted_tokens=accepted, per_position=per_pos,
                      accept_length=1.0 + accepted / drafts,
                      acceptance_rate=accepted / draft_tokens if draft_tokens else float("nan"),
                      length_histogram=hist)


SPEC_KNOBS = ("num_steps", "topk", "num_draft_tokens", "draft_model")   # + every key under spec.ngram
NO_SPECULATION = "no speculation runs (spec.method=none)"


class EngineAdapter(ABC):
    """One engine: its flags, parser, requests and counters, and the facts the rest of the workspace asks of it
    (its speculation rules, the SGLang patch launcher, how a running server is read back). Registered in
    experiments/engines/__init__.py."""
    name: str
    patchable = False            # served through sglang_patches.launch: the SGLang patches apply to it
    # cfg.limits key -> this engine's flag, pinned on every command line (baseline included)
    LIMIT_FLAGS: dict[str, str] = {}
    # spec.method -> the spec knobs (dotted, under spec.) that this adapter passes to the engine
    USED_KNOBS: dict[str, frozenset[str]] = {}
    # (spec.method, knob) -> why the engine does not use it
    IGNORED_WHY: dict[tuple[str, str], str] = {}

    def limit_args(self, limits: LimitsView, given: list[str]) -> list[str]:
        """`limits` as this engine's flags, except a flag among `given` (the site's and engine.extra_args: that
        choice is explicit, and the same for the baseline)."""
        given_flags = {a.split("=", 1)[0] for a in given}
        out: list[str] = []
        for key, flag in self.LIMIT_FLAGS.items():
            value = getattr(limits, key)
            if value is not None and flag not in given_flags:
                out += [flag, str(value)]
        return out

    @property
    def speculation(self):
        """How the engine drafts and verifies, for the analysis of its runs (experiments/engines/speculation.py)."""
        from experiments.engines.speculation import Speculation
        return Speculation()

    @property
    def head_layout(self):
        """How the engine reads an EAGLE-3 head's aux layer ids (experiments/engines/head_layout.py)."""
        from experiments.engines.head_layout import head_layout
        return head_layout(self.name)

    def args_for_installed_version(self, python: str, args: list[str]) -> list[str]:
        """`args` spelled as the release that `python` imports knows them (flags renamed between releases)."""
        return args

    def launch_env(self, launch: LaunchView, env: dict[str, str]) -> dict[str, str]:
        """Variables this engine's launch adds to `env` (the engine's and the site's)."""
        return {}

    def api_key_launch(self, key: str) -> tuple[list[str], dict[str, str]]:
        """The arguments and environment that make a server this workspace starts want `key` (SGLang: --api-key)."""
        return ["--api-key", key], {}

    def read_served(self, url: str):
        """A running server's own account of itself (experiments/engines/served.py)."""
        raise NotImplementedError(f"no reader of a running {self.name} server's settings")

    def head_config_problems(self, head: dict) -> list[str]:
        """What in an EAGLE-3 head's config.json this engine cannot load (checked before launch)."""
        return []

    @abstractmethod
    def effective_limits(self, base_url: str, validation: Validation) -> dict[str, float | str]:
        """The limits the running server really uses (max running requests, batched tokens, context, ...)."""

    def unused_knobs(self, spec: SpecView, patches: Sequence[str]) -> list[str]:
        """Dotted names of the non-null spec settings this engine, method and release will not use."""
        return list(self.unused_knob_reasons(spec, patches))

    def unused_knob_reasons(self, spec: SpecView, patches: Sequence[str] = ()) -> dict[str, str]:
        """{dotted name: 'name=value: why'} for every non-null spec setting the engine would ignore; `patches` are
        the SGLang patches the launch applies (the expert budget is read by one of them)."""
        out = {}
        values = {**{k: getattr(spec, k) for k in SPEC_KNOBS}, **{f"ngram.{k}": v for k, v in spec.ngram.items()}}
        for knob, value in values.items():
            why = None if value is None else self.knob_ignored(spec, knob, value)
            if why:
                out[f"spec.{knob}"] = f"spec.{knob}={value}: {why}"
        if spec.moe_expert_budget is not None and "moe_budget" not in patches:
            out["spec.moe_expert_budget"] = (f"spec.moe_expert_budget={spec.moe_expert_budget}: only the moe_budget "
                                             "patch reads it (option E, on SGLang)")
        return out

    def knob_ignored(self, spec: SpecView, knob: str, value: object) -> str | None:
        """Why `spec.<knob>=value` is not used by this engine for `spec.method`, or None when it is."""
        if spec.method == "none":
            return NO_SPECULATION
        if knob not in self.USED_KNOBS.get(spec.method, frozenset()):
            return self.IGNORED_WHY.get((spec.method, knob), f"{self.name} is not given it for method {spec.method}")
        return self.value_ignored(spec, knob, value)

    def value_ignored(self, spec: SpecView, knob: str, value: object) -> str | None:
        """A knob the engine takes, at a value it overrides by itself; None: used as given."""
        return None

    @abstractmethod
    def model_args(self, model: ModelView) -> list[str]: ...

    def spec_args(self, spec: SpecView) -> list[str]:
        """Flags for `spec.method`: none, ngram or eagle3."""
        builders = {"none": lambda spec: [], "ngram": self.ngram_args, "eagle3": self.eagle3_args}
        return builders[spec.method](spec)

    @abstractmethod
    def ngram_args(self, spec: SpecView) -> list[str]: ...

    @abstractmethod
    def eagle3_args(self, spec: SpecView) -> list[str]: ...

    @abstractmethod
    def validate(self, python: str, args: list[str]) -> Validation:
        """Run the engine's own parser over `args`; never starts a server."""

    @abstractmethod
    def stream_request(self, prompt_ids: list[int], max_tokens: int, temperature: float,
                       model: str, seed: int | None = None) -> tuple[str, dict]:
        """(path, JSON body) of a streaming generation request; `seed` seeds sampling at temperature > 0."""

    @abstractmethod
    def parse_event(self, event: dict, tokens_so_far: int) -> StreamDelta:
        """The tokens an event adds; raises StreamError for an event the request fails on (`checked_event`)."""

    def parse_raw(self, data: bytes, tokens_so_far: int) -> StreamDelta | None:
        """A cheaper parse of an event's raw bytes where the protocol allows one; None: use parse_event."""
        return None

    @abstractmethod
    def topk_request(self, prompt_ids: list[int], model: str) -> tuple[str, dict]:
        """(path, body) of a one-token request returning the most likely next tokens (TOPK of them)."""

    @abstractmethod
    def parse_topk(self, response: dict) -> list[tuple[int, float]]: ...

    def metrics_snapshot(self, metrics_text: str | None) -> dict | None:
        """Counters to difference over a measured window (None: the engine reports per request)."""
        return None

    @abstractmethod
    def acceptance(self, before: dict | None, after: dict | None,
                   metas: list[dict]) -> Acceptance | None: ...

    def request_step_s(self, record: dict) -> float | None:
        """One finished request's decode step in seconds: the time from its first token to its last over the
        engine steps between them. Here from the streamed chunks' arrival (each chunk is one engine step of the
        request); an engine that times its requests itself overrides this with its own clock."""
        times, tokens = record.get("chunk_times_s") or [], record.get("chunk_tokens") or []
        if record.get("error") or len(times) < 3 or len(tokens) != len(times):
            return None
        return (times[-1] - times[0]) / (len(times) - 1)

    step_source = "client: streamed chunks' arrival (one chunk per engine step)"

    @abstractmethod
    def request_acceptance(self, record: dict) -> RequestAcceptance | None:
        """Acceptance of one JSONL request record (client.RequestRecord as a dict); None for a failed
        request or one the engine reports nothing for. The numbers are returned whether or not the run
        speculates: the caller knows its spec.method (a baseline run gives one token per step)."""

