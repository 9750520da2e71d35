"""How each engine drafts and verifies, as far as the analysis of its finished runs needs to know: the tokens a
decode step verifies, which n-gram drafter a replay reproduces, the CUDA-graph batch limit among its arguments.
The analysis asks `speculation_of(engine)`; it never names an engine itself."""
from __future__ import annotations

from dataclasses import dataclass

from experiments.config.views import SpecView


@dataclass(frozen=True)
class NgramWindow:
    """The prompt-lookup window a replay of the engine's n-gram drafter uses."""
    min_match: int
    max_match: int
    k: int
    exact: bool   # the engine's drafter is the prompt-lookup rule the replay implements; else a lower bound
    prompt_tail: int | None = None   # the drafter sees only the prompt's last this many tokens (None: all of it)


class Speculation:
    """An engine that verifies 1 + the tokens it drafted on each step and has no replayable n-gram drafter."""
    fixed_verify_width = False   # True: every speculative step verifies the same number of tokens per sequence
    # the box model (experiments/analysis/speedup/box.py): verify steps above the site's verify CUDA-graph cap run
    # eager, and the INT4 MoE kernel the engine serves Kimi-K2.5 with on SM 12.x
    eager_above_verify_graph_cap = False
    int4_moe_kernel = "marlin"

    def overhead_terms(self, method: str) -> str:
        """The prefix of the box terms that price this engine's per-step speculative overhead."""
        return method

    def verified_per_step(self, spec: SpecView) -> float | None:
        """Tokens a speculative decode step verifies per sequence where the engine fixes it, else None."""
        return None

    def ngram_window(self, spec: SpecView) -> NgramWindow | None:
        """The replay window of the run's n-gram drafter; None when the run drafted no n-grams. Raises
        ValueError when the run left a setting the window needs unset."""
        return None

    def graph_batch_limit(self, args: list[str]) -> int | None:
        """The largest batch the engine decodes with CUDA graphs, where its arguments set one."""
        return None


class VLLMSpeculation(Speculation):
    """vLLM verifies 1 + the drafted tokens per step; its n-gram drafter is prompt lookup (v1/spec_decode/
    ngram_proposer.py), which experiments/analysis/ngram_replay.py reproduces exactly."""
    int4_moe_kernel = "triton"

    def overhead_terms(self, method: str) -> str:
        return "vllm"   # one overhead for every drafter

    def ngram_window(self, spec: SpecView) -> NgramWindow | None:
        if spec.method != "ngram":
            return None
        values = {"spec.ngram.min_match": spec.ngram.get("min_match"),
                  "spec.ngram.max_match": spec.ngram.get("max_match"), "spec.num_draft_tokens": spec.num_draft_tokens}
        unset = [key for key, value in values.items() if value is None]
        if unset:
            raise ValueError(f"{', '.join(unset)} not set")
        return NgramWindow(*(int(v) for v in values.values()), exact=True)


class SGLangSpeculation(Speculation):
    """SGLang verifies its whole draft tree on every step."""
    fixed_verify_width = True
    eager_above_verify_graph_cap = True
    default_trie_depth = 18
    graph_batch_flags = ("--cuda-graph-max-bs-decode", "--cuda-graph-max-bs")

    def verified_per_step(self, spec: SpecView) -> float | None:
        """`--speculative-num-draft-tokens` including the root (NGRAM pads every request's tree to that size,
        ngram_worker.py asserts bs * draft_token_num); EAGLE-3 with topk 1: num_steps + 1, whatever was passed
        (arg_groups/speculative_hook.py)."""
        if spec.method == "none":
            return None
        if spec.method == "eagle3" and spec.topk == 1 and spec.num_steps is not None:
            return float(spec.num_steps + 1)
        if spec.num_draft_tokens is not None:
            return float(spec.num_draft_tokens)
        return None if spec.num_steps is None else float(spec.num_steps + 1)

    def ngram_window(self, spec: SpecView) -> NgramWindow | None:
        """SGLang's NGRAM drafts a BFS tree from a trie over prompts and outputs of all requests (its C++ cache
        needs a JIT toolchain that does not import on this CPU): approximated by one prompt-lookup chain per
        request, matches up to max_trie_depth, the tree's num_draft_tokens - 1 tokens as the chain. The trie never
        holds a prompt's body: each step inserts the last max_trie_depth tokens of prompt + output
        (ngram_worker.py `_update_ngram_corpus`, "we will not insert [the extend] for now"), so the chain looks
        up the prompt's last max_trie_depth tokens and the output. A chain sees less than the tree and the
        shared trie, so its replay is a lower bound."""
        if spec.method != "ngram":
            return None
        if spec.num_draft_tokens is None:
            raise ValueError("spec.num_draft_tokens not set")
        depth = spec.ngram.get("max_trie_depth") or self.default_trie_depth
        return NgramWindow(1, int(depth), max(1, spec.num_draft_tokens - 1), exact=False, prompt_tail=int(depth))

    def graph_batch_limit(self, args: list[str]) -> int | None:
        """The first of the flags given, as `--flag value` or `--flag=value` (argparse takes both)."""
        for flag in self.graph_batch_flags:
            for i, arg in enumerate(args):
                if arg == flag and i + 1 < len(args):
                    value = args[i + 1]
                elif arg.startswith(f"{flag}="):
                    value = arg.split("=", 1)[1]
                else:
                    continue
                try:
                    return int(value)
                except ValueError:
                    return None
        return None


def speculation_of(engine: str) -> Speculation:
    """The engine's rules (its adapter's, experiments/engines/__init__.py); an engine the workspace does not know
    gets the plain ones (nothing fixed, no replay)."""
    from experiments.engines import adapter_for
    try:
        return adapter_for(engine).speculation
    except ValueError:
        return Speculation()
