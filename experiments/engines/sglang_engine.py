"""SGLang adapter: /generate streaming with input ids, acceptance from per-request meta_info."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig

from experiments.engines.base import TOPK, Acceptance, EngineAdapter, StreamDelta, Validation
from experiments.engines.sglang_versions import flags_for_version, installed_sglang

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

    def stream_request(self, prompt_ids, max_tokens, temperature, model):
        return "/generate", {"input_ids": prompt_ids, "stream": True,
                             "sampling_params": {"max_new_tokens": max_tokens, "temperature": temperature}}

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



_NULL = re.compile(rb"\s*:\s*null\b")     # after "finish_reason": the request is still running
_LIST = re.compile(rb"\s*:\s*\[")          # after "output_ids"


def _interpreter(python: str) -> str:
    """A bare `python`/`python3` (the engine config's default without SGLANG_PYTHON) means the interpreter
    running the workspace when that one imports SGLang (the H200 host: python3 with the bundle on PYTHONPATH)."""
    if python in ("python", "python3") and importlib.util.find_spec("sglang") is not None:
        return sys.executable
    return python
