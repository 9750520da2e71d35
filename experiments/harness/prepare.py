"""The workload, prepared before anything starts: conversations loaded and validated, cut or refused against
the model's context, and the visit plan (warm-ups apart, disjoint measured slices) fixed. A dry run prepares it
too, so a broken row is refused before an engine is ever launched."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from experiments.config.views import RunView, WorkloadView
from experiments.harness.workloads.formats import Conversation, WorkloadError
from experiments.harness.workloads.loader import SHAREGPT, load_workload, prompt_set_digest
from experiments.harness.workloads.render import fit_to_context, render_turn
from experiments.harness.workloads.sampling import VisitPlan, plan_visits

SHAREGPT_SPARE = 16     # sampled beyond what is measured: some first turns do not fit the context


@dataclass
class PreparedWorkload:
    conversations: list[Conversation]    # the measured ones and the warm-up pool
    plan: VisitPlan
    digest: str
    tokenizer: object | None             # None: the model is not on this machine (a box plan checked from here)
    workload: WorkloadView               # the typed workload settings the plan was made from

    def render(self) -> Callable[[Conversation, int, list[str]], list[int]]:
        if self.tokenizer is None:
            raise WorkloadError("no tokenizer: the model folder is not on this machine")
        tok = self.tokenizer
        return lambda conv, turn, answers: render_turn(tok, conv, turn, answers)

    def measured_ids(self) -> set[str]:
        return {c.id for convs in self.plan.measured.values() for c in convs}


def _tokenizer(model_path: str):
    if not (Path(model_path) / "config.json").exists():
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_path)


def prepare_workload(run: RunView) -> PreparedWorkload:
    """The run's workload for its model; raises WorkloadError naming the file, line and fix."""
    w = run.workload
    # real conversations (ShareGPT: ~90k of them) are sampled first and cut to fit; a user's file is refused
    cut = w.prompt_set == SHAREGPT
    sample = w.num_prompts + w.warmup_requests + SHAREGPT_SPARE if cut and w.num_prompts else None
    convs = load_workload(w.prompt_set, w.format, sample, w.seed, w.max_turns)
    tokenizer = _tokenizer(run.model.path)
    if tokenizer is not None:
        convs = fit_to_context(convs, tokenizer, int(run.model.max_model_len), w.max_tokens, cut)
    slices = w.repetitions * w.blocks   # per level: its repetitions, each in blocks
    plan = plan_visits(convs, w.concurrency, slices, w.warmup_requests, w.seed, w.reuse_prompts, w.num_prompts)
    return PreparedWorkload(convs, plan, prompt_set_digest(convs), tokenizer, w)
