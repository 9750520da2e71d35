"""What an engine server wrote about itself in its log, read back as data: the resolved arguments and the CUDA-graph
sizes it captured. The harness writes each server's output to one file, each start preceded by its command line
(`$ <argv>`, experiments/harness/server.py); the last start is the one read.

- SGLang 0.5.14 / 0.5.23: `server_args=ServerArgs(k=v, ...)` (every resolved argument) and, per graph,
  `Capture <target|draft> <decode|verify|extend|prefill> CUDA graph begin. backend=..., bs=[...]` (or
  `num_tokens=[...]` for the piecewise prefill graphs); releases before 0.5.14 wrote `Capture cuda graph bs [...]`.
- vLLM 0.32: `non-default args: {...}` (what the command line set) and `Initializing a V1 LLM engine (v...) with
  config: k=v, ...` (the resolved config; the capture sizes are `compilation_config['cudagraph_capture_sizes']`).
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

_SGLANG_ARGS = re.compile(r"server_args=ServerArgs\((.*)\)\s*$")
_SGLANG_GRAPH = re.compile(r"Capture ([\w ]+?) CUDA graph begin\.\s*(.*)$")
_SGLANG_OLD_GRAPH = re.compile(r"Capture cuda graph bs (\[[\d, ]*\])")
_VLLM_NON_DEFAULT = re.compile(r"non-default args: (\{.*\})\s*$")
_VLLM_CONFIG = re.compile(r"Initializing a V1 LLM engine \(v([^)]+)\) with config: (.*)$")
_SGLANG_VERSION = re.compile(r'"sglang_version": "([^"]+)"')
_OPEN = {"(": ")", "[": "]", "{": "}"}


@dataclass
class LogFacts:
    """A server's own account of itself from its log: `args` resolved (SGLang's ServerArgs, vLLM's engine config),
    `non_default` what the command line set (vLLM), `graphs` name -> {"bs": [...], ...} of every captured graph."""
    engine: str = ""
    version: str = ""
    args: dict[str, object] = field(default_factory=dict)
    non_default: dict[str, object] = field(default_factory=dict)
    graphs: dict[str, dict[str, object]] = field(default_factory=dict)

    @property
    def found(self) -> bool:
        return bool(self.args or self.non_default or self.graphs)

    def to_dict(self) -> dict:
        return {"engine": self.engine, "version": self.version, "args": self.args, "non_default": self.non_default,
                "graphs": self.graphs}


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """`text` split at `sep` outside quotes and brackets (a Python repr's argument list)."""
    parts, depth, quote, start, i = [], 0, "", 0, 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def literal(text: str) -> object:
    """A repr's value as Python data where it is a literal, else the text itself (`torch.bfloat16`, `Foo(...)`)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


def parse_kwargs(text: str) -> dict[str, object]:
    """`k=v, k2=v2` (a dataclass repr's body) as a dict; a part without `=` is left out."""
    out: dict[str, object] = {}
    for part in split_top_level(text):
        key, eq, value = part.partition("=")
        if eq and key.strip().isidentifier():
            out[key.strip()] = literal(value.strip())
    return out


def last_start(text: str) -> str:
    """The log of the last start in a file the harness appends each start to (`$ <argv>` opens each)."""
    starts = [m.start() for m in re.finditer(r"^\$ ", text, flags=re.M)]
    return text[starts[-1]:] if starts else text


def parse_log(text: str) -> LogFacts:
    """The facts of the last server start in `text` (empty LogFacts where the log says none)."""
    facts = LogFacts()
    for line in last_start(text).splitlines():
        _read_line(facts, line)
    if not facts.engine and facts.graphs:
        facts.engine = "sglang"
    return facts


def _read_line(facts: LogFacts, line: str) -> None:
    if (m := _SGLANG_ARGS.search(line)) is not None:
        facts.engine, facts.args = "sglang", parse_kwargs(m.group(1))
    elif (m := _SGLANG_GRAPH.search(line)) is not None:
        facts.graphs[m.group(1).strip()] = _graph(m.group(2))
    elif (m := _SGLANG_OLD_GRAPH.search(line)) is not None:
        facts.graphs["decode"] = {"bs": literal(m.group(1))}
    elif (m := _VLLM_NON_DEFAULT.search(line)) is not None:
        value = literal(m.group(1))
        facts.engine, facts.non_default = "vllm", value if isinstance(value, dict) else {"raw": m.group(1)}
    elif (m := _VLLM_CONFIG.search(line)) is not None:
        facts.engine, facts.version, facts.args = "vllm", m.group(1), parse_kwargs(m.group(2))
        sizes = _vllm_capture_sizes(facts.args.get("compilation_config"))
        if sizes is not None:
            facts.graphs["cudagraph"] = {"bs": sizes}
    elif (m := _SGLANG_VERSION.search(line)) is not None and not facts.version:
        facts.version = m.group(1)


def _graph(rest: str) -> dict[str, object]:
    """`backend=full, num_tokens_per_bs=4, bs=[1, 2], avail mem=90.41 GB` -> its fields (memory left out)."""
    fields = {k: v for k, v in parse_kwargs(rest).items() if k in ("backend", "num_tokens_per_bs", "bs", "num_tokens")}
    return {k: v for k, v in fields.items() if not isinstance(v, str) or k == "backend"}


def _vllm_capture_sizes(compilation: object) -> list | None:
    """The capture sizes in vLLM's compilation config (a dict repr whose enums do not parse as literals)."""
    if isinstance(compilation, dict):
        sizes = compilation.get("cudagraph_capture_sizes")
        return list(sizes) if isinstance(sizes, list | tuple) else None
    m = re.search(r"'cudagraph_capture_sizes': (\[[\d, ]*\])", str(compilation or ""))
    return literal(m.group(1)) if m else None


def read_log(path: Path | str | None) -> LogFacts:
    """`parse_log` of a log file; an absent or unreadable file gives empty facts."""
    if path is None:
        return LogFacts()
    try:
        return parse_log(Path(path).read_text(errors="replace"))
    except OSError:
        return LogFacts()


def resolved_args(facts: dict) -> dict:
    """The resolved arguments in an engine-facts record (experiments/harness/serving_env.py `engine_facts`): the
    log's (every ServerArgs field; vLLM's engine config with its non-default args), else the server's settings."""
    log = facts.get("log") or {}
    if log.get("args") or log.get("non_default"):
        return {**{f"config.{k}": v for k, v in (log.get("non_default") or {}).items()}, **(log.get("args") or {})}
    return dict((facts.get("served") or {}).get("settings") or {})
