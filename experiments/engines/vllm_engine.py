"""vLLM adapter: OpenAI completions with token ids, Prometheus spec-decode counters."""
from __future__ import annotations

import json
import os
import socket
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

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
    checked_event,
)
from experiments.engines.limits import get_json, scalar

if TYPE_CHECKING:
    from experiments.config.views import ModelView, SpecView

CHECK_SCRIPT = Path(__file__).with_name("vllm_check.py")
CHECKER_ENV = "SPECWS_VLLM_CHECKER"   # a Unix socket where `vllm_check.py --serve` answers checks
CHECK_TIMEOUT_S = 300
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


NGRAM_KEYS = {"min_match": "prompt_lookup_min", "max_match": "prompt_lookup_max"}
TRIE_ONLY = ("SGLang's NGRAM trie setting; vLLM's prompt lookup has none (its window is "
             "spec.ngram.min_match..max_match); remove it or use engine=sglang")
EAGLE_NO_NGRAM = "EAGLE-3 drafts with its head; n-gram settings are not passed"
# Read in vLLM 0.32's config/speculative.py (SpeculativeConfig) and this adapter's speculative config.
VLLM_IGNORED = {
    ("ngram", "num_steps"): "vLLM's prompt lookup drafts spec.num_draft_tokens tokens in one step",
    ("ngram", "topk"): "vLLM's prompt lookup proposes one chain, no tree",
    ("ngram", "draft_model"): "n-gram drafts from the prompt and the output; no draft model is loaded",
    **{("ngram", f"ngram.{k}"): TRIE_ONLY for k in ("min_bfs_breadth", "max_bfs_breadth", "max_trie_depth")},
    **{("eagle3", f"ngram.{k}"): EAGLE_NO_NGRAM
       for k in ("min_match", "max_match", "min_bfs_breadth", "max_bfs_breadth", "max_trie_depth")},
}
# vLLM 0.32 (config/observability.py): per-request acceptance in the response's metrics.speculative_decoding,
# refused by vLLM without speculation, so only speculative command lines carry it.
PER_REQUEST_METRICS = ("--per-request-spec-decode-metrics", "summary")


class VLLMAdapter(EngineAdapter):
    name = "vllm"

    @property
    def speculation(self):
        from experiments.engines.speculation import VLLMSpeculation
        return VLLMSpeculation()

    def api_key_launch(self, key: str) -> tuple[list[str], dict[str, str]]:
        """VLLM_API_KEY: the check of --api-key (entrypoints/serve/middleware/register.py), kept off the command
        line, which any process of the host can read."""
        return [], {"VLLM_API_KEY": key}

    def read_served(self, url: str):
        from experiments.engines.served import read_vllm
        return read_vllm(url)
    LIMIT_FLAGS = {"max_running_requests": "--max-num-seqs"}
    USED_KNOBS = {"ngram": frozenset({"num_draft_tokens", *(f"ngram.{k}" for k in NGRAM_KEYS)}),
                  "eagle3": frozenset({"draft_model", "num_steps", "topk", "num_draft_tokens"})}
    IGNORED_WHY = VLLM_IGNORED

    def value_ignored(self, spec: SpecView, knob: str, value: object) -> str | None:
        """vLLM's EAGLE-3 as configured here is a chain of spec.num_steps drafts, verified as num_steps + 1."""
        if spec.method != "eagle3" or spec.num_steps is None:
            return None
        if knob == "topk" and int(value) != 1:
            return ("the workspace runs vLLM's EAGLE-3 as a chain of spec.num_steps drafts (no tree; vLLM takes a "
                    "tree only through speculative_token_tree); use topk=1 or engine=sglang")
        if knob == "num_draft_tokens" and int(value) != int(spec.num_steps) + 1:
            return (f"vLLM verifies num_speculative_tokens + 1 = spec.num_steps + 1 = {int(spec.num_steps) + 1} "
                    "tokens per step; set spec.num_steps instead")
        return None

    def effective_limits(self, base_url: str, validation: Validation) -> dict[str, float | str]:
        """vLLM serves no config endpoint: the limits its engine config resolved when the command line was
        validated (create_engine_config(), run where the model folder is here), else the served max_model_len."""
        if validation.limits:
            return {k: scalar(v) for k, v in validation.limits.items() if scalar(v) is not None}
        models = (get_json(f"{base_url}/v1/models") or {}).get("data") or [{}]
        return {"max_model_len": float(models[0]["max_model_len"])} if models[0].get("max_model_len") else {}

    def model_args(self, model: ModelView) -> list[str]:
        args = ["--model", str(model.path), "--served-model-name", model.name]
        return args + (["--trust-remote-code"] if model.trust_remote_code else [])

    def ngram_args(self, spec: SpecView) -> list[str]:
        """A null spec.ngram.min_match / max_match is left to vLLM's own default (0.32, SpeculativeConfig:
        both null -> 5 and 5; one null -> the other's value)."""
        conf = {"method": "ngram", "num_speculative_tokens": spec.num_draft_tokens}
        for key, name in NGRAM_KEYS.items():
            if spec.ngram.get(key) is not None:
                conf[name] = spec.ngram[key]
        return ["--speculative-config", json.dumps(conf), *PER_REQUEST_METRICS]

    def eagle3_args(self, spec: SpecView) -> list[str]:
        conf = {"method": "eagle3", "model": str(spec.draft_model), "num_speculative_tokens": spec.num_steps}
        return ["--speculative-config", json.dumps(conf), *PER_REQUEST_METRICS]

    def validate(self, python: str, args: list[str]) -> Validation:
        """vLLM's serve parser; plus create_engine_config() when the model folder is here to read
        (a box command line checked elsewhere, e.g. Kimi-K2.5 in CI, gets the parser only)."""
        return self.validate_many(python, [args])[0]

    def validate_many(self, python: str, argvs: list[list[str]]) -> list[Validation]:
        """One vLLM import for several command lines: the checker serving at $SPECWS_VLLM_CHECKER when there is
        one for `python` (the test suite starts one per session), else one `vllm_check.py --batch` process."""
        checks = [[model_config_present(args), list(args)] for args in argvs]
        results = ask_checker(python, checks) or _check_in(python, checks)
        return [Validation(r["ok"], r["version"], r["error"], limits=r.get("limits") or {}) for r in results]

    def stream_request(self, prompt_ids, max_tokens, temperature, model, seed=None):
        body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": temperature,
                "stream": True, "return_token_ids": True, "ignore_eos": False,
                "stream_options": {"include_usage": True}}   # the final usage chunk carries per-request metrics
        return "/v1/completions", body | ({"seed": seed} if seed is not None else {})

    def parse_event(self, event: dict, tokens_so_far: int) -> StreamDelta:
        choices = checked_event(event).get("choices") or []
        if not choices:   # the usage chunk after the last token: a speculative server's per-request metrics
            spec = (event.get("metrics") or {}).get("speculative_decoding")
            return StreamDelta(meta=spec if isinstance(spec, dict) else None)
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
        """vLLM's own per-request numbers when the server sent them (`record["meta"]`, see spec_meta_acceptance),
        else from the streamed chunks (a baseline, or records written before): every chunk is one engine step of
        the request and a chunk of n tokens accepted n - 1 drafts, in order. Steps that carried no draft (the
        prefill's first token; n-gram found no match) then count as steps accepting nothing, so that
        accept_length is a lower bound of vLLM's own (which counts only steps with a draft), and `proposed` is
        unknown (None). Chunks merged by a client slower than the engine would raise it again."""
        if not record.get("error") and (record.get("meta") or {}).get("acceptance_histogram") is not None:
            return spec_meta_acceptance(record["meta"])
        chunks = [int(n) for n in record.get("chunk_tokens") or [] if int(n) > 0]
        if record.get("error") or not chunks:
            return None
        by_accepted: dict[int, int] = defaultdict(int)
        for n in chunks:
            by_accepted[n - 1] += 1
        return RequestAcceptance(steps=len(chunks), emitted=sum(chunks), proposed=None,
                                 accepted_per_position=accepted_per_position(by_accepted))


def spec_meta_acceptance(meta: dict) -> RequestAcceptance:
    """vLLM 0.32's metrics.speculative_decoding (entrypoints/generate/base/protocol.py SpeculativeDecodingMetrics,
    filled by v1/metrics/stats.py RequestSpecDecodeMetrics, observed by the scheduler for steps that carried a
    draft): acceptance_histogram[j] = such steps that accepted j drafts; steps = those steps, emitted = their
    tokens (bonus included), so accept_length = vLLM's mean_acceptance_length."""
    hist = [int(c) for c in meta["acceptance_histogram"]]
    steps, accepted = sum(hist), sum(j * c for j, c in enumerate(hist))
    return RequestAcceptance(steps=steps, emitted=steps + accepted, proposed=int(meta.get("num_draft_tokens") or 0),
                             accepted_per_position=accepted_per_position(dict(enumerate(hist))),
                             correct_drafts=accepted)


def ask_checker(python: str, checks: list[list]) -> list[dict] | None:
    """The answers of the checker serving at $SPECWS_VLLM_CHECKER (`vllm_check.py --serve`), or None when none
    serves there, it serves another interpreter or it failed."""
    path = os.environ.get(CHECKER_ENV)
    if not path:
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(CHECK_TIMEOUT_S)
            conn.connect(path)
            conn.sendall((json.dumps({"python": python, "env": dict(os.environ), "checks": checks}) + "\n").encode())
            line = conn.makefile("r").readline()
    except OSError:
        return None
    answers = json.loads(line) if line.strip() else None
    return answers if isinstance(answers, list) and len(answers) == len(checks) else None


def _check_in(python: str, checks: list[list]) -> list[dict]:
    proc = subprocess.run([python, str(CHECK_SCRIPT), "--batch"], input=json.dumps(checks), capture_output=True,
                          text=True, timeout=CHECK_TIMEOUT_S)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        error = f"vLLM parser could not run with {python}:\n{tail}"
        return [{"ok": False, "version": "unknown", "error": error} for _ in checks]
    return json.loads(lines[-1])


def model_config_present(args: list[str]) -> bool:
    """Whether the --model folder has the config.json that vLLM's engine config reads."""
    if "--model" not in args:
        return False
    return (Path(args[args.index("--model") + 1]) / "config.json").exists()
