"""SGLang adapter: /generate streaming with input ids, acceptance from per-request meta_info."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig

from experiments.engines.base import TOPK, Acceptance, EngineAdapter, StreamDelta, Validation

CHECK_SCRIPT = Path(__file__).with_name("sglang_check.py")


class SGLangAdapter(EngineAdapter):
    name = "sglang"

    def model_args(self, cfg: DictConfig) -> list[str]:
        args = ["--model-path", str(cfg.model.path), "--served-model-name", cfg.model.name,
                "--context-length", str(cfg.model.max_model_len), "--enable-metrics"]
        return args + (["--trust-remote-code"] if cfg.model.trust_remote_code else [])

    def ngram_args(self, spec: DictConfig) -> list[str]:
        ng = spec.ngram
        return ["--speculative-algorithm", "NGRAM",
                "--speculative-num-draft-tokens", str(spec.num_draft_tokens),
                "--speculative-ngram-min-bfs-breadth", str(ng.min_bfs_breadth),
                "--speculative-ngram-max-bfs-breadth", str(ng.max_bfs_breadth),
                "--speculative-ngram-max-trie-depth", str(ng.max_trie_depth)]

    def eagle3_args(self, spec: DictConfig) -> list[str]:
        return ["--speculative-algorithm", "EAGLE3",
                "--speculative-draft-model-path", str(spec.draft_model),
                "--speculative-num-steps", str(spec.num_steps),
                "--speculative-eagle-topk", str(spec.topk),
                "--speculative-num-draft-tokens", str(spec.num_draft_tokens)]

    def validate(self, python: str, args: list[str]) -> Validation:
        """SGLang's own ServerArgs parser + post-init checks, in the interpreter that will serve."""
        if python in (sys.executable, "python", "python3") and _importable("sglang"):
            from experiments.engines.sglang_check import check
            return Validation(**check(args))
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run([python, str(CHECK_SCRIPT), *args], capture_output=True, text=True,
                              timeout=300, env=env)
        lines = proc.stdout.strip().splitlines()
        if not lines:
            return Validation(False, "unknown", f"SGLang parser could not run with {python}: "
                              f"{proc.stderr.strip()[-800:]}")
        out = json.loads(lines[-1])
        return Validation(out["ok"], out["version"], out["error"])

    def stream_request(self, prompt_ids, max_tokens, temperature, model):
        return "/generate", {"input_ids": prompt_ids, "stream": True,
                             "sampling_params": {"max_new_tokens": max_tokens, "temperature": temperature}}

    def parse_event(self, event: dict, tokens_so_far: int) -> StreamDelta:
        # SGLang streams cumulative output_ids unless --incremental-streaming-output is set.
        ids = list(event.get("output_ids") or [])
        new = ids[tokens_so_far:] if len(ids) >= tokens_so_far else ids
        meta = event.get("meta_info") or {}
        finished = meta.get("finish_reason") is not None
        # text is cumulative too: taken once, at the end
        return StreamDelta(token_ids=new, text=event.get("text", "") if finished else "", finished=finished,
                           meta=meta if finished else None)

    def topk_request(self, prompt_ids, model):
        return "/generate", {"input_ids": prompt_ids, "return_logprob": True, "top_logprobs_num": TOPK,
                             "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}

    def parse_topk(self, response: dict) -> list[tuple[int, float]]:
        top = response["meta_info"]["output_top_logprobs"][0]
        return sorted(((int(tid), lp) for lp, tid, *_ in top), key=lambda p: -p[1])

    def acceptance(self, before, after, metas) -> Acceptance | None:
        """Per request: accept length = completion_tokens / spec_verify_ct (bonus token included)."""
        metas = [m for m in metas if m and m.get("spec_verify_ct")]
        if not metas:
            return None
        steps = sum(int(m["spec_verify_ct"]) for m in metas)
        tokens = sum(int(m["completion_tokens"]) for m in metas)
        proposed = sum(int(m.get("spec_proposed_drafts") or m.get("spec_draft_token_num") or 0) for m in metas)
        accepted = tokens - steps
        hist: dict[int, float] = {}
        for m in metas:
            for n, count in enumerate(m.get("spec_accept_histogram") or []):
                hist[n + 1] = hist.get(n + 1, 0.0) + count
        total = sum(hist.values())
        hist = {n: c / total for n, c in hist.items()} if total else {}
        # P(position i accepted) = P(step emits more than i+1 tokens), from the histogram when given.
        per_pos = [sum(p for n, p in hist.items() if n > i + 1) for i in range(max(hist, default=1) - 1)]
        return Acceptance(drafts=steps, draft_tokens=proposed, accepted_tokens=accepted,
                          per_position=per_pos, accept_length=tokens / steps,
                          acceptance_rate=accepted / proposed if proposed else float("nan"),
                          length_histogram=hist)


def _importable(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None

