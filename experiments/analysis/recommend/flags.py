"""Engine flags for the recommended choices, and schedules across loads.

A choice's flags are the engine adapters' own (experiments/engines/*_engine.py `spec_args`), for SGLang and for
vLLM, with the settings that engine would not be passed (`unused_knob_reasons`). Where the choice changes with the
load, one deployment can follow it only where the engine switches speculation by batch size (docs/reference/
recommend.md has the source lines): vLLM 0.32's `num_speculative_tokens_per_batch_size` in --speculative-config
(inclusive batch-size ranges -> tokens, 0 = none; it changes the draft length only, not the method or its other
settings), SGLang 0.5.23's `--speculative-adaptive` with a config file of per-batch-size `candidate_steps`
(EAGLE/EAGLE3 with topk 1 only; a slot with one candidate is a fixed step count, 0 = none). Elsewhere the cost of
one setting for the whole range is given: per level, its measured speedup over the level's choice's."""
from __future__ import annotations

import json
from typing import Any

from experiments.analysis.recommend.decision import NO_SPECULATION, Candidate, Decision
from experiments.config.views import spec_view
from experiments.engines import ENGINE_NAMES, adapter_for

ADAPTIVE_FILE = "sglang-adaptive.json"
VLLM_SCHEDULE = "vllm/config/speculative.py:491 (num_speculative_tokens_per_batch_size)"
SGLANG_ADAPTIVE = "sglang/srt/speculative/adaptive_spec_params.py:61 (EAGLE/EAGLE3 only), :75 (topk 1 only)"
# a draft length set differs between choices that a schedule can still follow; everything else must agree
LENGTH_KEYS = ("num_draft_tokens", "num_steps")


def choice_flags(spec: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """engine -> {flags, not_passed}: the adapter's speculative flags for `spec` (None: no speculation, no flags)
    and why each setting it leaves out is left out."""
    if spec is None:
        return {name: {"flags": [], "not_passed": []} for name in ENGINE_NAMES}
    view, out = spec_view(spec), {}
    for name in ENGINE_NAMES:
        adapter = adapter_for(name)
        out[name] = {"flags": [str(a) for a in adapter.spec_args(view)],
                     "not_passed": list(adapter.unused_knob_reasons(view).values())}
    return out


def _length(spec: dict[str, Any]) -> int:
    """The draft length a batch-size schedule sets: vLLM's num_speculative_tokens (n-gram: the draft tokens;
    EAGLE-3: the draft steps, as the adapters pass them), SGLang's speculative_num_steps."""
    return int(spec["num_draft_tokens"] if spec["method"] == "ngram" else spec["num_steps"])


def _others(spec: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in spec.items() if k not in LENGTH_KEYS}, sort_keys=True, default=str)


def _plan(ranges: list[tuple[int, int, Candidate | None]]) -> list[tuple[int, int, int]]:
    """(first batch size, last, draft length) per range: the first from 1, each later one from its first level;
    batch sizes between two ranges' levels keep the lower range's setting (vLLM carries a range forward through a
    gap, SGLang routes a batch to the slot at or below it)."""
    return [(1 if i == 0 else lo, hi, 0 if c is None else _length(c.spec)) for i, (lo, hi, c) in enumerate(ranges)]


def vllm_schedule(ranges: list[tuple[int, int, Candidate | None]]) -> dict[str, Any]:
    chosen = [c for *_, c in ranges if c is not None]
    if len({_others(c.spec) for c in chosen}) > 1:
        return {"flags": None, "why": f"the choices differ in more than the draft length; vLLM's schedule sets only "
                                      f"the number of speculative tokens per batch size ({VLLM_SCHEDULE})"}
    top = max(chosen, key=lambda c: _length(c.spec))
    flags = choice_flags(top.spec)["vllm"]["flags"]
    at = flags.index("--speculative-config") + 1
    conf = json.loads(flags[at]) | {"num_speculative_tokens_per_batch_size": [list(p) for p in _plan(ranges)]}
    flags[at] = json.dumps(conf)
    return {"flags": flags, "source": VLLM_SCHEDULE}


def sglang_schedule(ranges: list[tuple[int, int, Candidate | None]]) -> dict[str, Any]:
    chosen = [c for *_, c in ranges if c is not None]
    if any(c.spec["method"] != "eagle3" or (c.spec.get("topk") or 1) != 1 for c in chosen):
        return {"flags": None, "why": "SGLang switches speculation by batch size only through --speculative-adaptive, "
                                      f"which takes EAGLE/EAGLE3 with topk 1 ({SGLANG_ADAPTIVE}); its NGRAM worker "
                                      "has no adaptive controller (sglang/srt/speculative/ngram_worker.py:108)"}
    if len({_others(c.spec) for c in chosen}) > 1:
        return {"flags": None, "why": "the choices differ in more than the draft steps (e.g. the draft model)"}
    top = max(chosen, key=lambda c: _length(c.spec))
    config = {str(lo): {"candidate_steps": [steps]} for lo, _, steps in _plan(ranges)}
    flags = choice_flags(top.spec)["sglang"]["flags"] + ["--speculative-adaptive", "--speculative-adaptive-config",
                                                         ADAPTIVE_FILE]
    return {"flags": flags, "config_file": ADAPTIVE_FILE, "config": config, "source": SGLANG_ADAPTIVE}


def _value(label: str, d: Decision) -> float | str:
    """A setting's measured speedup at a decision's load; why not, where it has none to offer."""
    if label == NO_SPECULATION:
        return 1.0
    found = next((c for c in d.candidates if c.label == label), None)
    if found is None:
        return "not measured"
    return f"breaks {', '.join(found.breaks)}" if found.breaks else found.speedup.estimate


def single_setting_costs(decisions: list[Decision]) -> list[dict[str, Any]]:
    """For each setting measured in the range (and no speculation): per level the throughput it loses against the
    level's choice (1 - its speedup / the choice's, from the measured ratios), and its worst loss; a setting that
    was not measured at a level or breaks a target there cannot stand for the whole range."""
    best = {d.load.label: d.speedup.estimate if d.speedup else 1.0 for d in decisions}
    labels = [NO_SPECULATION, *sorted({c.label for d in decisions for c in d.candidates})]
    out = []
    for label in labels:
        values = {d.load.label: _value(label, d) for d in decisions}
        loss = {k: 1.0 - v / best[k] if isinstance(v, float) else v for k, v in values.items()}
        usable = all(isinstance(v, float) for v in loss.values())
        out.append({"setting": label, "loss": loss, "usable": usable,
                    "worst_loss": max(loss.values()) if usable else None})
    return sorted(out, key=lambda r: (not r["usable"], r["worst_loss"] if r["usable"] else 0.0))


def schedule(ranges: list[tuple[int, int, Candidate | None]], decisions: list[Decision]) -> dict[str, Any]:
    """What one deployment does across the closed-loop range: nothing to schedule when every level has the same
    choice; else each engine's schedule where it has one, and what one setting for the whole range costs."""
    if len({None if c is None else c.label for *_, c in ranges}) <= 1:
        return {"needed": False}
    return {"needed": True, "vllm": vllm_schedule(ranges), "sglang": sglang_schedule(ranges),
            "single_setting": single_setting_costs(decisions)}
