"""Engine limits: what each engine changes by itself in speculative mode, what the workspace pins on every
command line (baseline included), what is read back from a running server, and the comparison of two runs.

Speculative mode changes these by itself (read in the releases' source):
- SGLang 0.5.6 / 0.5.9 (server_args.py: ServerArgs._handle_speculative_decoding): max_running_requests = 48
  when not given (EAGLE family and NGRAM); enable_mixed_chunk = False; disable_overlap_schedule = True for
  NGRAM, and for EAGLE unless SGLANG_ENABLE_SPEC_V2; NGRAM: speculative_eagle_topk = max_bfs_breadth.
- SGLang 0.5.14 / 0.5.23 (arg_groups/speculative_hook.py: _handle_eagle_family, _handle_ngram,
  _handle_dflash, _handle_frozen_kv_mtp): max_running_requests = 48 when not given; enable_mixed_chunk =
  False; disable_overlap_schedule = True on CPU only (0.5.23 _disable_overlap_schedule_for_cpu); NGRAM:
  speculative_eagle_topk = max_bfs_breadth, num_steps = draft tokens // topk; EAGLE topk 1: num_draft_tokens
  = num_steps + 1. Both: a finer CUDA-graph batch-size list (cuda_graph_hook.py /
  ServerArgs._generate_decode_cuda_graph_batch_sizes), and a smaller KV pool with a draft model.
- vLLM 0.32 (config/vllm.py: VllmConfig.__post_init__): async_scheduling off for methods other than the
  EAGLE/MTP family, ngram_gpu, draft_model, dspark, dflash (so off for CPU `ngram`; CPU: always off,
  platforms/cpu.py); max_num_scheduled_tokens set (VllmConfig._set_max_num_scheduled_tokens); CUDA-graph
  sizes from max_num_seqs x (1 + k) (VllmConfig._set_cudagraph_sizes). max_num_seqs and
  max_num_batched_tokens are not changed by speculation (engine/arg_utils.py:
  _set_default_max_num_seqs_and_batched_tokens_args).
"""
from __future__ import annotations

import json
import urllib.request

from experiments.engines.auth import auth_headers

# Differ between a baseline and a speculative run by construction, so two runs are not compared on them:
# the speculative settings, and what speculation fixes itself and cannot be pinned without handicapping the
# baseline (overlap/async scheduling, the KV pool that a draft model shares, and the CUDA-graph batch ceiling a
# site lowers for speculative runs whose verify graphs do not fit: conf/site/blackwell.yaml cuda_graph_max_bs,
# decode to 128, verify to 32; the speedup model prices the eager levels above it).
SPEC_ONLY_PREFIXES = ("speculative_", "spec_", "num_speculative_tokens", "prompt_lookup_")
INHERENT = frozenset({"disable_overlap_schedule", "async_scheduling", "max_total_num_tokens", "token_capacity",
                      "max_num_scheduled_tokens", "cuda_graph_max_bs"})


def limits_mismatch(a: dict, b: dict) -> list[str]:
    """'key: a vs b' for every limit both runs report and on which they differ, speculation-only and
    speculation-inherent keys left out (see INHERENT)."""
    keys = sorted(k for k in a.keys() & b.keys() if not k.startswith(SPEC_ONLY_PREFIXES) and k not in INHERENT)
    return [f"{k}: {a[k]} vs {b[k]}" for k in keys if not _same(a[k], b[k])]


def _same(x: object, y: object) -> bool:
    """Equal as numbers where both read as numbers ('48' == 48.0), else as text ('True' == True)."""
    try:
        return float(x) == float(y)
    except (TypeError, ValueError):
        return str(x) == str(y)


def authorized(url: str) -> urllib.request.Request:
    """A GET of `url` with its server's API key (experiments.engines.auth)."""
    return urllib.request.Request(url, headers=auth_headers(url))


def get_json(url: str, timeout_s: float = 10.0) -> dict | None:
    """The JSON at `url`, or None when the server does not answer it."""
    try:
        with urllib.request.urlopen(authorized(url), timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def scalar(value: object) -> float | str | None:
    """A limit as logged: numbers as float, booleans and names as text, anything else left out."""
    if isinstance(value, bool) or isinstance(value, str):
        return str(value)
    if isinstance(value, int | float):
        return float(value)
    return None
