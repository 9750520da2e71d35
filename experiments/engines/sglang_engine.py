"""SGLang adapter: /generate streaming with input ids, acceptance from per-request meta_info."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from experiments.engines.base import (
    TOPK,
    Acceptance,
    EngineAdapter,
    RequestAcceptance,
    StreamDelta,
    Validation,
    accepted_per_position,
    checked_event,
)
from experiments.engines.limits import get_json, scalar
from experiments.engines.sglang_versions import flags_for_version, installed_sglang

if TYPE_CHECKING:
    from experiments.config.views import LaunchView, ModelView, SpecView

CHECK_SCRIPT = Path(__file__).with_name("sglang_check.py")


def draft_quantization_args(draft_model: str) -> list[str]:
    """SGLang (0.5.14, 0.5.23) gives the draft the target's --quantization unless told otherwise: a bf16
    EAGLE-3 head beside `--quantization compressed-tensors` (the box profile's) then dies at load in
    CompressedTensorsConfig() (seen on the H200, 2026-12-02). A head is unquantised unless its own config.json
    declares a quantization_config; one not on disk here (a hub id) is taken as bf16, as the published heads are."""
    config = Path(str(draft_model)) / "config.json"
    if config.is_file() and "quantization_config" in json.loads(config.read_text()):
        return []
    return ["--speculative-draft-model-quantization", "unquant"]


NGRAM_FLAGS = {"min_bfs_breadth": "--speculative-ngram-min-bfs-breadth",
               "max_bfs_breadth": "--speculative-ngram-max-bfs-breadth",
               "max_trie_depth": "--speculative-ngram-max-trie-depth"}
NGRAM_WINDOW = ("SGLang's NGRAM drafter has no such setting (it matches suffixes through its trie, up to "
                "spec.ngram.max_trie_depth tokens; the match-window flags of 0.5.6-0.5.9 are gone since 0.5.10 and "
                "never passed); remove it or use engine=vllm")
EAGLE_NO_NGRAM = "EAGLE-3 drafts with its head; n-gram settings are not passed"
# Read in speculative_hook.py (_handle_ngram, _handle_eagle_family) of 0.5.14 and 0.5.23, and
# server_args.py (_handle_speculative_decoding) of 0.5.6 and 0.5.9.
SGLANG_IGNORED = {
    ("ngram", "num_steps"): "SGLang's NGRAM derives its steps itself (draft tokens // tree breadth); the tokens "
                            "verified per step are spec.num_draft_tokens",
    ("ngram", "topk"): "SGLang's NGRAM sets its tree breadth to spec.ngram.max_bfs_breadth, overriding "
                       "--speculative-eagle-topk",
    ("ngram", "draft_model"): "n-gram drafts from the prompt and the output; no draft model is loaded",
    ("ngram", "ngram.min_match"): NGRAM_WINDOW,
    ("ngram", "ngram.max_match"): NGRAM_WINDOW,
    **{("eagle3", f"ngram.{k}"): EAGLE_NO_NGRAM for k in ("min_match", "max_match", *NGRAM_FLAGS)},
}


class SGLangAdapter(EngineAdapter):
    name = "sglang"
    patchable = True

    @property
    def speculation(self):
        from experiments.engines.speculation import SGLangSpeculation
        return SGLangSpeculation()

    def launch_env(self, launch: LaunchView, env: dict[str, str]) -> dict[str, str]:
        """The patch launcher's environment in front of SGLang's entry point (engine.module=sglang_patches.launch):
        which patches, the site, the PYTHONPATH it extends, and what the patches read; none otherwise."""
        if launch.engine.module != "sglang_patches.launch":
            return {}
        from sglang_patches.launch import launcher_env
        pythonpath = str(env.get("PYTHONPATH") or os.environ.get("PYTHONPATH", ""))
        return launcher_env(launch.patches, launch.site, pythonpath, launch.forced_patches) | launch.patch_env

    def read_served(self, url: str):
        from experiments.engines.served import read_sglang
        return read_sglang(url)
    LIMIT_FLAGS = {"max_running_requests": "--max-running-requests"}
    USED_KNOBS = {"ngram": frozenset({"num_draft_tokens", *(f"ngram.{k}" for k in NGRAM_FLAGS)}),
                  "eagle3": frozenset({"draft_model", "num_steps", "topk", "num_draft_tokens"})}
    IGNORED_WHY = SGLANG_IGNORED

    def value_ignored(self, spec: SpecView, knob: str, value: object) -> str | None:
        """EAGLE with topk 1: SGLang verifies num_steps + 1 tokens whatever --speculative-num-draft-tokens says."""
        if (spec.method, knob) == ("eagle3", "num_draft_tokens") and spec.topk == 1 and spec.num_steps is not None \
                and int(value) != int(spec.num_steps) + 1:
            return (f"with spec.topk=1 SGLang verifies spec.num_steps + 1 = {int(spec.num_steps) + 1} tokens per "
                    "step whatever is passed; set spec.num_steps instead")
        return None

    def head_config_problems(self, head: dict) -> list[str]:
        """llama_eagle3.py (0.5.14, 0.5.23) reads config.draft_vocab_size unless the embeddings are tied; a
        config.json without the key dies at load (AttributeError on the H200, 2026-12-02). null is taken as the
        target's vocabulary, with the target's lm_head."""
        if head.get("tie_word_embeddings") or "draft_vocab_size" in head:
            return []
        return ["no draft_vocab_size in its config.json (SGLang's llama_eagle3 reads it; null means the target's "
                "vocabulary)"]

    def effective_limits(self, base_url: str, validation: Validation) -> dict[str, float | str]:
        """From /server_info (0.5.14 on; /get_server_info before): the resolved server arguments, the
        scheduler's info and its internal state (the scheduler's own max running requests and KV capacity)."""
        info = get_json(f"{base_url}/server_info") or get_json(f"{base_url}/get_server_info") or {}
        return server_info_limits(info)

    def model_args(self, model: ModelView) -> list[str]:
        args = ["--model-path", str(model.path), "--served-model-name", model.name,
                "--context-length", str(model.max_model_len), "--enable-metrics"]
        return args + (["--trust-remote-code"] if model.trust_remote_code else [])

    def ngram_args(self, spec: SpecView) -> list[str]:
        """A null spec.ngram setting is left to SGLang's own default (0.5.14 / 0.5.23: min_bfs_breadth 1,
        max_bfs_breadth 10, max_trie_depth 18; before 0.5.10 the trie depth was branch_length, also 18)."""
        args = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(spec.num_draft_tokens)]
        for key, flag in NGRAM_FLAGS.items():
            if spec.ngram.get(key) is not None:
                args += [flag, str(spec.ngram[key])]
        return args

    def eagle3_args(self, spec: SpecView) -> list[str]:
        return ["--speculative-algorithm", "EAGLE3",
                "--speculative-draft-model-path", str(spec.draft_model),
                "--speculative-num-steps", str(spec.num_steps),
                "--speculative-eagle-topk", str(spec.topk),
                "--speculative-num-draft-tokens", str(spec.num_draft_tokens),
                *draft_quantization_args(spec.draft_model)]

    def args_for_installed_version(self, python: str, args: list[str]) -> list[str]:
        """Flags renamed between releases, spelled as the SGLang that `python` imports knows them."""
        installed = installed_sglang(_interpreter(python))
        return flags_for_version(args, installed.version) if installed else list(args)

    def validate(self, python: str, args: list[str]) -> Validation:
        """SGLang's own ServerArgs parser + post-init checks, in the interpreter that will serve."""
        return self.validate_many(python, [args])[0]

    def validate_many(self, python: str, argvs: list[list[str]]) -> list[Validation]:
        """One parser start for several command lines. In this process when `python` imports the very
        SGLang this process imports; otherwise in `python` itself."""
        python = _interpreter(python)
        installed = installed_sglang(python)
        if installed is None:
            return [Validation(False, "absent", f"{python} cannot import sglang (SGLANG_PYTHON / PYTHONPATH)")
                    for _ in argvs]
        here = importlib.util.find_spec("sglang")
        if here is not None and here.origin == installed.origin:
            from experiments.engines.sglang_check import check_many
            results = check_many(argvs)
        else:
            results = self._check_in(python, argvs)
        out = [Validation(r["ok"], r["version"], r["error"]) for r in results]
        for v in out:
            if v.ok and v.version != installed.version:  # a spec built for one release, checked by another
                v.ok, v.error = False, (f"{python} has sglang {installed.version} installed but its parser "
                                        f"reports {v.version}")
        return out

    @staticmethod
    def _check_in(python: str, argvs: list[list[str]]) -> list[dict]:
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run([python, str(CHECK_SCRIPT), "--batch"], input=json.dumps(argvs),
                              capture_output=True, text=True, timeout=300, env=env)
        lines = proc.stdout.strip().splitlines()
        if not lines:
            error = f"SGLang parser could not run with {python}: {proc.stderr.strip()[-800:]}"
            return [{"ok": False, "version": "unknown", "error": error} for _ in argvs]
        return json.loads(lines[-1])

    def stream_request(self, prompt_ids, max_tokens, temperature, model, seed=None):
        sampling = {"max_new_tokens": max_tokens, "temperature": temperature}
        if seed is not None:
            sampling["sampling_seed"] = seed
        return "/generate", {"input_ids": prompt_ids, "stream": True, "sampling_params": sampling}

    def parse_raw(self, data: bytes, tokens_so_far: int) -> StreamDelta | None:
        """The new tail of an unfinished event's cumulative output_ids, read from the raw bytes without
        parsing the event: the ids before it are counted (commas), only the new ones are converted; the
        text and meta_info are left alone (taken from the finishing event, which parse_event reads whole).
        None, so that the caller parses the whole event, when the event is finished, carries no
        `"finish_reason": null`, or does not look like SGLang's stream event."""
        i = data.rfind(b'"finish_reason"')       # bytes.find/count/rfind: C loops, no copies of the list
        if i < 0 or _NULL.match(data, i + 15) is None:
            return None
        j = data.find(b'"output_ids"')
        m = _LIST.match(data, j + 12) if j >= 0 else None
        if m is None:
            return None
        start = m.end()
        end = data.find(b"]", start)
        if end < 0:
            return None
        commas = data.count(b",", start, end)
        total = commas + 1 if commas or data[start:end].strip() else 0
        fresh = total - tokens_so_far
        if fresh <= 0:
            return StreamDelta() if fresh == 0 else None
        pos = start - 1
        if fresh < total:
            pos = end
            for _ in range(fresh):
                pos = data.rfind(b",", start, pos)
        try:
            return StreamDelta(token_ids=[int(x) for x in data[pos + 1:end].split(b",")])
        except ValueError:
            return None

    def parse_event(self, event: dict, tokens_so_far: int) -> StreamDelta:
        # SGLang streams cumulative output_ids unless --incremental-streaming-output is set.
        ids = list(checked_event(event).get("output_ids") or [])
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
        """Over the requests' finishing meta_info (every release's shape, see `meta_acceptance`): accept
        length = completion tokens / verification steps, as SGLang's own spec_accept_length."""
        parts = [a for a in (meta_acceptance(m) for m in metas if m) if a is not None]
        return merge_requests(parts)

    step_source = "server: meta_info decode_throughput (first token to finish, SGLang's clock) over its steps"

    def request_step_s(self, record: dict) -> float | None:
        """SGLang's own decode time of the request ((completion tokens - 1) / decode_throughput: from the first
        token to the finish, on the server's clock) over its steps after the first token: the verification steps
        (spec_verify_ct) where it speculates, else one per token."""
        meta = record.get("meta") or {}
        rate, tokens = meta.get("decode_throughput"), meta.get("completion_tokens")
        if record.get("error") or not rate or not tokens or tokens < 3:
            return None
        steps = meta.get("spec_verify_ct") or tokens - 1
        return (tokens - 1) / rate / steps if steps > 1 else None

    def request_acceptance(self, record: dict) -> RequestAcceptance | None:
        """From the finishing event's meta_info (`record["meta"]`): steps = SGLang's verification steps,
        emitted = completion tokens (the prefill's first token included, as in SGLang's spec_accept_length)."""
        if record.get("error") or not record.get("meta"):
            return None
        return meta_acceptance(record["meta"])


# meta_info keys per release (tokenizer_manager.TokenizerManager: the finished branch of
# _handle_batch_output in 0.5.2, _calculate_spec_decoding_metrics from 0.5.6), newest name first:
ACCEPTED_KEYS = ("spec_num_correct_drafts",   # 0.5.14, 0.5.23
                 "spec_accepted_drafts",      # 0.5.14 alias, gone in 0.5.23
                 "spec_accept_token_num")     # 0.5.6, 0.5.9
PROPOSED_KEYS = ("spec_num_proposed_drafts", "spec_proposed_drafts", "spec_draft_token_num")
HISTOGRAM_KEYS = ("spec_correct_drafts_histogram",  # 0.5.14, 0.5.23
                  "spec_accept_histogram")          # 0.5.9; 0.5.14 alias, gone in 0.5.23


def _first(meta: dict, keys: tuple[str, ...]):
    return next((meta[k] for k in keys if meta.get(k) is not None), None)


def meta_acceptance(meta: dict) -> RequestAcceptance | None:
    """One request's speculation from its finishing meta_info, whatever the release (0.5.2 ... 0.5.23).

    spec_verify_ct counts verification steps (the prefill is none); the accepted count and the histogram
    count accepted draft tokens per step, the bonus token excluded (histogram[n] = steps that accepted n
    drafts); proposed = steps x (speculative_num_draft_tokens - 1). 0.5.2 reports spec_verify_ct only: the
    accepted drafts are then the completion tokens beyond the prefill's and one per step."""
    steps, emitted = int(meta.get("spec_verify_ct") or 0), int(meta.get("completion_tokens") or 0)
    if steps <= 0:
        return None
    hist = _first(meta, HISTOGRAM_KEYS)
    correct, proposed = _first(meta, ACCEPTED_KEYS), _first(meta, PROPOSED_KEYS)
    return RequestAcceptance(
        steps=steps, emitted=emitted, proposed=None if proposed is None else int(proposed),
        accepted_per_position=None if hist is None else accepted_per_position(dict(enumerate(hist))),
        correct_drafts=max(0, emitted - 1 - steps) if correct is None else int(correct))


def merge_requests(parts: list[RequestAcceptance]) -> Acceptance | None:
    """Requests' acceptance summed: rates over the requests that report the numbers behind them."""
    if not parts:
        return None
    steps, emitted = sum(a.steps for a in parts), sum(a.emitted for a in parts)
    accepted = sum(a.accepted for a in parts)
    with_proposed = [a for a in parts if a.proposed]
    proposed = sum(a.proposed for a in with_proposed)
    rate = sum(a.accepted for a in with_proposed) / proposed if proposed else float("nan")
    per_pos, hist = _positions([a for a in parts if a.accepted_per_position is not None])
    return Acceptance(drafts=steps, draft_tokens=proposed, accepted_tokens=accepted, per_position=per_pos,
                      accept_length=emitted / steps, acceptance_rate=rate, length_histogram=hist)


def _positions(parts: list[RequestAcceptance]) -> tuple[list[float], dict[int, float]]:
    """P(draft position i accepted) and P(step emits n tokens) over the steps of `parts`."""
    steps = sum(a.steps for a in parts)
    if not steps:
        return [], {}
    width = max(len(a.accepted_per_position) for a in parts)
    counts = [sum(a.accepted_per_position[i] for a in parts if i < len(a.accepted_per_position))
              for i in range(width)]
    at_least = [steps, *counts, 0]
    hist = {n + 1: (at_least[n] - at_least[n + 1]) / steps for n in range(width + 1)}
    return [c / steps for c in counts], hist


SERVER_INFO_LIMITS = ("max_running_requests", "max_total_num_tokens", "max_prefill_tokens", "chunked_prefill_size",
                      "context_length", "max_req_input_len", "page_size", "schedule_policy", "enable_mixed_chunk",
                      "disable_overlap_schedule", "disable_cuda_graph", "speculative_algorithm",
                      "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")


def server_info_limits(info: dict) -> dict[str, float | str]:
    """The limits in a /server_info answer, whatever the release: flat server arguments and scheduler info,
    the decode CUDA-graph batch ceiling (a JSON config from 0.5.14, a flag before), and the first DP rank's
    internal state (effective_max_running_requests_per_dp, memory_usage.token_capacity)."""
    out = {k: scalar(info[k]) for k in SERVER_INFO_LIMITS if scalar(info.get(k)) is not None}
    graphs = (info.get("cuda_graph_config") or {}).get("decode") if isinstance(info.get("cuda_graph_config"), dict) \
        else None
    max_bs = (graphs or {}).get("max_bs") or info.get("cuda_graph_max_bs_decode") or info.get("cuda_graph_max_bs")
    if scalar(max_bs) is not None:
        out["cuda_graph_max_bs"] = scalar(max_bs)
    states = info.get("internal_states") or [{}]
    state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    if scalar(state.get("effective_max_running_requests_per_dp")) is not None:
        out["effective_max_running_requests"] = scalar(state["effective_max_running_requests_per_dp"])
    capacity = (state.get("memory_usage") or {}).get("token_capacity")
    if scalar(capacity) is not None:
        out["token_capacity"] = scalar(capacity)
    return out


_NULL = re.compile(rb"\s*:\s*null\b")     # after "finish_reason": the request is still running
_LIST = re.compile(rb"\s*:\s*\[")          # after "output_ids"


def _interpreter(python: str) -> str:
    """A bare `python`/`python3` (the engine config's default without SGLANG_PYTHON) means the interpreter
    running the workspace when that one imports SGLang (the H200 host: python3 with the bundle on PYTHONPATH)."""
    if python in ("python", "python3") and importlib.util.find_spec("sglang") is not None:
        return sys.executable
    return python
