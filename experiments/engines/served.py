"""What a running server says it runs, read back from its own endpoints: for a server the runner did not start
(`server.url`) these settings stand in for the command line, so pairing and the limits are judged on them.

- vLLM 0.32: `/version`; `/v1/models` (served name, model root, max_model_len); `/metrics` (the
  `vllm:cache_config_info` labels, the process start time, and whether the spec-decode counters exist); and, when
  the server runs with VLLM_SERVER_DEV_MODE=1, `/server_info?config_format=json`: the whole VllmConfig and the
  VLLM_* environment (entrypoints/serve/dev/server_info/api_router.py).
- SGLang 0.5.14 / 0.5.23: `/server_info` (`/get_server_info` before): the resolved server arguments, `version`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from urllib.request import urlopen

from prometheus_client.parser import text_string_to_metric_families

from experiments.engines.limits import INHERENT, SPEC_ONLY_PREFIXES, authorized, get_json, scalar
from experiments.engines.sglang_engine import server_info_limits

# Differ between two launches of one command line (ids, ports, shared-memory names) or between a baseline and a
# speculative server by construction (what speculation sets itself: the per-request spec metrics the adapter asks
# for, vLLM's DP-sync choice, the CUDA-graph sizes derived from k or capped by the site, the KV blocks a draft model
# shares, SGLang's enable_mixed_chunk, arg_groups/speculative_hook.py in 0.5.14).
VOLATILE = frozenset({"instance_id", "port", "host", "nccl_port", "dist_init_addr", "metrics_http_port",
                      "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME", "random_seed", "pid", "file_storage_path",
                      "per_request_spec_decode_metrics", "disable_nccl_for_dp_synchronization",
                      "cudagraph_capture_sizes", "max_cudagraph_capture_size", "bs_to_padded_graph_size",
                      "num_gpu_blocks", "kv_cache_memory_bytes", "kv_cache_size_tokens", "kv_cache_max_concurrency",
                      "engine", "internal_states", "cuda_graph_bs", "cuda_graph_config", "enable_mixed_chunk",
                      "version", "kv_events"})
SPEC_PREFIXES = (*SPEC_ONLY_PREFIXES, "speculative", "speculation")


@dataclass
class Served:
    """A running server's own account of itself: `settings` flat (dotted key -> text), where each came from."""
    url: str
    engine: str
    version: str
    settings: dict[str, str] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    instance: str = ""              # changes when the server restarts (its process start time)
    start_time: float | None = None  # the serving process's start (its /metrics process_start_time_seconds)
    limits: dict[str, float | str] = field(default_factory=dict)
    speculation: dict[str, str] = field(default_factory=dict)   # method (+ k where the server says)

    def to_dict(self) -> dict:
        return {"url": self.url, "engine": self.engine, "version": self.version, "sources": self.sources,
                "instance": self.instance, "limits": self.limits, "speculation": self.speculation,
                "settings": self.settings}


def flat(node: object, prefix: str = "") -> dict[str, str]:
    """Nested JSON as dotted keys -> text (lists as JSON). An empty mapping given whole contributes nothing; one
    nested inside is a setting whose value is empty ('{}')."""
    if isinstance(node, dict) and not node:
        return {}
    return _flat(node, prefix)


def _flat(node: object, prefix: str) -> dict[str, str]:
    if isinstance(node, dict) and node:
        out: dict[str, str] = {}
        for key, value in node.items():
            out |= _flat(value, f"{prefix}.{key}" if prefix else str(key))
        return out
    return {prefix: json.dumps(node) if isinstance(node, list) else str(node)}


def _compared(key: str) -> bool:
    leaf = key.rsplit(".", 1)[-1]
    head = key.split(".", 1)[0]
    return not (leaf in VOLATILE or leaf in INHERENT or head in VOLATILE
                or any(part.startswith(SPEC_PREFIXES) for part in key.split(".")))


def settings_mismatch(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """'key: a vs b' for every setting both servers report and on which they differ, the speculative, the
    speculation-inherent and the per-launch ones (VOLATILE) left out."""
    keys = sorted(k for k in a.keys() & b.keys() if _compared(k))
    return [f"{k}: {a[k]} vs {b[k]}" for k in keys if a[k] != b[k]]


def behaviour_settings(settings: dict[str, str]) -> dict[str, str]:
    """The settings that make two servers comparable (the pairing key is taken over these)."""
    return {k: v for k, v in settings.items() if _compared(k)}


def _text(url: str, timeout_s: float = 10.0) -> str | None:
    try:
        with urlopen(authorized(url), timeout=timeout_s) as resp:
            return resp.read().decode(errors="replace")
    except (OSError, ValueError):
        return None


def _metric_facts(metrics_text: str | None) -> tuple[dict[str, str], float | None, bool]:
    """(cache_config_info labels, process start time, spec-decode counters present) from a /metrics page."""
    labels, start, spec = {}, None, False
    for family in text_string_to_metric_families(metrics_text or ""):
        if family.name == "vllm:cache_config_info" and family.samples:
            labels = {f"cache_config.{k}": v for k, v in family.samples[0].labels.items()}
        elif family.name == "process_start_time_seconds" and family.samples:
            start = float(family.samples[0].value)
        elif family.name.startswith("vllm:spec_decode_num_drafts"):
            spec = True
    return labels, start, spec


def _set_instance(served: Served, start: float | None) -> None:
    served.start_time = start
    served.instance = f"{served.url}@{start:.2f}" if start else served.url


def read_vllm(url: str) -> Served:
    answer = get_json(f"{url}/version")
    version = (answer or {}).get("version", "unknown")
    served = Served(url, "vllm", str(version), sources=["/version"] if answer is not None else [])
    models = (get_json(f"{url}/v1/models") or {}).get("data") or []
    if models:
        served.sources.append("/v1/models")
        first = models[0]
        served.settings |= {"served_models": json.dumps(sorted(m.get("id", "") for m in models)),
                            "model_root": str(first.get("root")), "max_model_len": str(first.get("max_model_len"))}
    labels, start, spec_counters = _metric_facts(_text(f"{url}/metrics"))
    if labels or start:
        served.sources.append("/metrics")
    served.settings |= labels
    _set_instance(served, start)
    info = get_json(f"{url}/server_info?config_format=json")
    config = (info or {}).get("vllm_config")
    if isinstance(config, dict):
        served.sources.append("/server_info")
        served.settings |= flat(config, "config") | flat((info or {}).get("vllm_env") or {}, "env")
        served.limits = _vllm_limits(config)
        spec = config.get("speculative_config") or {}
        served.speculation = {"method": str(spec.get("method") or "none")}
        if spec.get("num_speculative_tokens") is not None:
            served.speculation["k"] = str(spec["num_speculative_tokens"])
    else:
        served.limits = {"max_model_len": float(models[0]["max_model_len"])} if models and \
            models[0].get("max_model_len") else {}
        served.speculation = {"method": "speculating" if spec_counters else "none"}
    return served


def _vllm_limits(config: dict) -> dict[str, float | str]:
    """The same limits the command-line check reads from VllmConfig (experiments/engines/vllm_check.py)."""
    sched, model = config.get("scheduler_config") or {}, config.get("model_config") or {}
    out = {k: scalar(sched.get(k)) for k in ("max_num_seqs", "max_num_batched_tokens", "max_num_scheduled_tokens",
                                             "enable_chunked_prefill", "async_scheduling")}
    out["max_model_len"] = scalar(model.get("max_model_len"))
    return {k: v for k, v in out.items() if v is not None}


def read_sglang(url: str) -> Served:
    info = get_json(f"{url}/server_info") or get_json(f"{url}/get_server_info") or {}
    served = Served(url, "sglang", str(info.get("version", "unknown")), sources=["/server_info"] if info else [])
    top = {k: v for k, v in info.items() if k != "internal_states"}
    served.settings = flat(top)
    served.limits = server_info_limits(info)
    _, start, _ = _metric_facts(_text(f"{url}/metrics"))
    _set_instance(served, start)
    served.speculation = {"method": str(info.get("speculative_algorithm") or "none").lower()}
    if info.get("speculative_num_draft_tokens") is not None:
        served.speculation["k"] = str(info["speculative_num_draft_tokens"])
    return served


def expected_speculation(engine: str, method: str, num_steps: int | None, num_draft_tokens: int | None) -> dict:
    """What `read_vllm` / `read_sglang` report for a config's speculation: vLLM's num_speculative_tokens is the
    n-gram draft length or EAGLE's steps; SGLang reports its tokens verified per step."""
    if method == "none":
        return {"method": "none"}
    k = num_draft_tokens if engine == "sglang" or method == "ngram" else num_steps
    return {"method": method, **({"k": str(k)} if k is not None else {})}


def speculation_mismatch(expected: dict, served: dict) -> str | None:
    """Why a server's speculation is not the config's, or None (a server that says only that it speculates
    matches any speculative method)."""
    got = served.get("method", "none")
    want = expected["method"]
    if got == "speculating" and want != "none":
        return None
    if got != want:
        return f"it runs speculation {got!r}, the config asks for {want!r}"
    if "k" in expected and "k" in served and expected["k"] != served["k"]:
        return f"it drafts {served['k']} tokens per step, the config asks for {expected['k']}"
    return None
