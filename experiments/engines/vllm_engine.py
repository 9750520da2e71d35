"""vLLM adapter: OpenAI completions with token ids, Prometheus spec-decode counters."""
from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from pathlib import Path

from omegaconf import DictConfig
from prometheus_client.parser import text_string_to_metric_families

from experiments.engines.base import (
    TOPK,
    Acceptance,
    EngineAdapter,
    RequestAcceptance,
    StreamDelta,
    Validation,
    acceptance_from_positions,
    accepted_per_position,
)

CHECK_SCRIPT = Path(__file__).with_name("vllm_check.py")
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


class VLLMAdapter(EngineAdapter):
    name = "vllm"

    def model_args(self, cfg: DictConfig) -> list[str]:
        args = ["--model", str(cfg.model.path), "--served-model-name", cfg.model.name]
        return args + (["--trust-remote-code"] if cfg.model.trust_remote_code else [])

    def ngram_args(self, spec: DictConfig) -> list[str]:
        conf = {"method": "ngram", "num_speculative_tokens": spec.num_draft_tokens,
                "prompt_lookup_min": spec.ngram.min_match, "prompt_lookup_max": spec.ngram.max_match}
        return ["--speculative-config", json.dumps(conf)]

    def eagle3_args(self, spec: DictConfig) -> list[str]:
        conf = {"method": "eagle3", "model": str(spec.draft_model), "num_speculative_tokens": spec.num_steps}
        return ["--speculative-config", json.dumps(conf)]

    def validate(self, python: str, args: list[str]) -> Validation:
        """vLLM's serve parser; plus create_engine_config() when the model folder is here to read
        (a box command line checked elsewhere, e.g. Kimi-K2.5 in CI, gets the parser only)."""
        deep = ["--engine-config"] if model_config_present(args) else []
        proc = subprocess.run([python, str(CHECK_SCRIPT), *deep, "--", *args],
                              capture_output=True, text=True, timeout=300)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            return Validation(False, "unknown", f"vLLM parser could not run with {python}:\n{tail}")
        out = json.loads(lines[-1])
        return Validation(out["ok"], out["version"], out["error"])

    def stream_request(self, prompt_ids, max_tokens, temperature, model, seed=None):
        body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": temperature,
                "stream": True, "return_token_ids": True, "ignore_eos": False}
        return "/v1/completions", body | ({"seed": seed} if seed is not None else {})

    def parse_event(self, event: dict, tokens_so_far: int) -> StreamDelta:
        choices = event.get("choices") or []
        if not choices:
            return StreamDelta()
        choice = choices[0]
        return StreamDelta(token_ids=list(choice.get("token_ids") or []), text=choice.get("text") or "",
                           finished=choice.get("finish_reason") is not None)

    def topk_request(self, prompt_ids, model):
        return "/v1/completions", {"model": model, "prompt": prompt_ids, "max_tokens": 1,
                                   "temperature": 0.0, "logprobs": TOPK, "return_tokens_as_token_ids": True}

    def parse_topk(self, response: dict) -> list[tuple[int, float]]:
        top = response["choices"][0]["logprobs"]["top_logprobs"][0]
        pairs = [(int(tok.split(":", 1)[1]), lp) for tok, lp in top.items()]
        return sorted(pairs, key=lambda p: -p[1])

    def metrics_snapshot(self, metrics_text: str | None) -> dict | None:
        if metrics_text is None:
            return None
        totals: dict[str, float] = defaultdict(float)
        per_pos: dict[int, float] = defaultdict(float)
        for family in text_string_to_metric_families(metrics_text):
            for sample in family.samples:
                if not sample.name.endswith("_total"):
                    continue
                base = sample.name[: -len("_total")]
                if base in SPEC_COUNTERS:
                    totals[SPEC_COUNTERS[base]] += sample.value
                elif base == PER_POS:
                    per_pos[int(sample.labels["position"])] += sample.value
        return {"totals": dict(totals), "per_pos": dict(per_pos)}

    def acceptance(self, before, after, metas) -> Acceptance | None:
        if not after:
            return None
        before = before or {"totals": {}, "per_pos": {}}

        def delta(key: str) -> float:
            return after["totals"].get(key, 0.0) - before["totals"].get(key, 0.0)

        positions = sorted(after["per_pos"])
        per_pos = [after["per_pos"][p] - before["per_pos"].get(p, 0.0) for p in positions]
        return acceptance_from_positions(int(delta("drafts")), int(delta("draft_tokens")),
                                         int(delta("accepted")), per_pos)

    def request_acceptance(self, record: dict) -> RequestAcceptance | None:
        """From the streamed chunks: vLLM's counters are per server, not per request. Every chunk is one
        engine step of the request and a chunk of n tokens accepted n - 1 drafts, in order. Steps that carried
        no draft (the prefill's first token; n-gram found no match) count as steps accepting nothing, so
        accept_length is a lower bound of vLLM's own (which counts only steps with a draft), and `proposed`
        is unknown (None). Chunks merged by a client slower than the engine would raise it again."""
        chunks = [int(n) for n in record.get("chunk_tokens") or [] if int(n) > 0]
        if record.get("error") or not chunks:
            return None
        by_accepted: dict[int, int] = defaultdict(int)
        for n in chunks:
            by_accepted[n - 1] += 1
        return RequestAcceptance(steps=len(chunks), emitted=sum(chunks), proposed=None,
                                 accepted_per_position=accepted_per_position(by_accepted))


def model_config_present(args: list[str]) -> bool:
    """Whether the --model folder has the config.json that vLLM's engine config reads."""
    if "--model" not in args:
        return False
    return (Path(args[args.index("--model") + 1]) / "config.json").exists()
