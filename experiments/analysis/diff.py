"""`python -m experiments.analysis.diff RUN RUN [--tracking-uri URI] [--all]`: what differs between two runs, and
which of those differences the workspace knows to matter.

A RUN is an MLflow run id, or the offline id a run was imported under (`specws.imported_from`, a prefix of 8 or
more characters will do). The sections (experiments/analysis/diff_facts.py): engine arguments, captured CUDA-graph
sizes, host fingerprint, host calibration, packages, head digest, workload, limits, the rest of the config, the
run's bookkeeping. What a run did not record is said ("not recorded"), never guessed.

KNOWN: the first pattern (`section:key`, shell-style) that matches a difference says whether it matters
(`matters`), is known not to (`no effect`), or is not classified. Numbers of the host and of the calibration are
the same within TOLERANCE (relative)."""
from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from dataclasses import dataclass

from experiments.analysis.diff_facts import RunFacts, read_run

MATTERS, NO_EFFECT, UNKNOWN = "matters", "no effect", "not classified"
TOLERANCE = {"calibration": 0.10, "host": 0.01}
_GRAPHS = "captured CUDA graphs: a batch size without one runs eagerly, paying every launch on the host"
_PATH = "a path: the same files elsewhere (weights compared by the head and package digests)"
# (pattern, verdict, why): first match wins
KNOWN: tuple[tuple[str, str, str], ...] = (
    ("engine:max_running_requests", MATTERS, "the scheduler's batch cap; SGLang sizes its CUDA graphs by it"),
    ("engine:cuda_graph_*", MATTERS, _GRAPHS), ("engine:disable_cuda_graph*", MATTERS, _GRAPHS),
    ("graphs:*", MATTERS, _GRAPHS),
    ("engine:disable_overlap_schedule", MATTERS, "the overlap scheduler hides host scheduling under the GPU step"),
    ("engine:*attention_backend", MATTERS, "the attention kernels"),
    ("engine:*_backend", MATTERS, "a kernel or sampling backend"),
    ("engine:speculative_draft_model_path", NO_EFFECT, _PATH), ("engine:*model_path", NO_EFFECT, _PATH),
    ("engine:tokenizer_path", NO_EFFECT, _PATH), ("engine:*.model", NO_EFFECT, _PATH),
    ("engine:*speculative*", MATTERS, "the speculative settings"),
    ("engine:sglang_patches.*", MATTERS, "which SGLang patches ran"),
    ("engine:*dtype", MATTERS, "the numeric type"), ("engine:*quantization*", MATTERS, "the weights' format"),
    ("engine:enforce_eager", MATTERS, _GRAPHS), ("engine:compilation_config*", MATTERS, "vLLM's compilation"),
    ("engine:*tp_size", MATTERS, "tensor parallelism"),
    *((f"engine:{k}", MATTERS, "scheduling and batching") for k in (
        "chunked_prefill_size", "max_prefill_tokens", "schedule_policy", "page_size", "enable_mixed_chunk",
        "num_continuous_decode_steps", "stream_interval", "max_num_seqs", "max_num_batched_tokens",
        "async_scheduling", "context_length", "mem_fraction_static", "schedule_conservativeness",
        "enable_torch_compile")),
    *((f"engine:{k}", NO_EFFECT, "per-launch identity (port, seed, addresses, names)") for k in (
        "port", "host", "random_seed", "seed", "nccl_port", "dist_init_addr", "metrics_http_port", "config.port",
        "config.host", "file_storage_path", "served_model_name", "config.served_model_name", "(source)")),
    ("packages:*", MATTERS, "the engine's and its libraries' versions"),
    ("head:*", MATTERS, "the draft head's weights"),
    ("host:host.platform", UNKNOWN, "the kernel build: names the host image, not shown to set the speed"),
    ("host:specws.host", NO_EFFECT, "host name, CPU count and interpreter, compared one by one elsewhere"),
    ("host:host.accelerator", MATTERS, "GPU or CPU"),
    ("host:*cpu*", MATTERS, "the host's CPU: the engine's scheduler and launches run there"),
    ("host:*virtualized", MATTERS, "a VM's cores can be stolen"), ("host:*governor", MATTERS, "CPU clock policy"),
    ("host:windows.steal_pct*", MATTERS, "CPU time the hypervisor took"),
    ("host:gpu*", MATTERS, "the GPU, its driver, clocks and power limit"),
    ("host:host.*sha256", MATTERS, "the serving setup's digests"),
    ("calibration:*", MATTERS, "the host's measured state (experiments/harness/host_probe.py terms)"),
    ("workload:*", MATTERS, "what was measured: prompts, lengths, levels, repetitions"),
    ("limits:*", MATTERS, "the engine's limits"),
    ("config:spec.draft_model", NO_EFFECT, _PATH), ("config:model.drafters.*", NO_EFFECT, _PATH),
    ("config:model.path", NO_EFFECT, _PATH), ("config:engine.python", NO_EFFECT, _PATH),
    ("config:spec.*", MATTERS, "the speculative settings"), ("config:model.name", MATTERS, "the target model"),
    ("config:option.name", MATTERS, "the option"), ("config:*engine_args*", MATTERS, "the engine's flags"),
    ("config:engine.extra_args", MATTERS, "the engine's flags"), ("config:engine.name", MATTERS, "the engine"),
    ("run:git.commit", UNKNOWN, "the workspace's code"),
    ("run:specws.server_reused", UNKNOWN, "a server kept warm from an earlier run"),
    ("run:*", NO_EFFECT, "the run's bookkeeping: ids, links, ports, store, analysis results"),
)


@dataclass(frozen=True)
class Difference:
    section: str
    key: str
    a: str | None        # None: not recorded in that run
    b: str | None
    verdict: str         # MATTERS, NO_EFFECT or UNKNOWN
    why: str = ""


def classify(section: str, key: str) -> tuple[str, str]:
    """(verdict, why) of a difference in `section` at `key` (KNOWN's first match)."""
    name = f"{section}:{key}"
    return next(((v, why) for pattern, v, why in KNOWN if fnmatch.fnmatchcase(name, pattern)), (UNKNOWN, ""))


def _same(section: str, a: str, b: str) -> bool:
    if a == b:
        return True
    tolerance = TOLERANCE.get(section)
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return tolerance is not None and abs(x - y) <= tolerance * max(abs(x), abs(y))


DRAFT_PATHS = ("engine:speculative_draft_model_path", "config:spec.draft_model", "config:model.drafters.*")


def _in_context(a: RunFacts, b: RunFacts, section: str, key: str) -> tuple[str, str] | None:
    """A verdict that depends on the two runs: n-gram settings where neither drafts by n-gram; a draft head's
    path, which matters only where the heads' digests differ (or are not recorded to tell)."""
    name = f"{section}:{key}"
    if key.startswith("spec.ngram.") and all(f.sections.get("config", {}).get("spec.method", "ngram") != "ngram"
                                             for f in (a, b)):
        return NO_EFFECT, "n-gram settings; neither run drafts by n-gram"
    if any(fnmatch.fnmatchcase(name, p) for p in DRAFT_PATHS):
        heads = [f.sections.get("head", {}).get("sha256") for f in (a, b)]
        if None in heads:
            return UNKNOWN, "another head path, and no head sha256 recorded to say whether the weights differ"
        return (NO_EFFECT, "same head sha256") if heads[0] == heads[1] else (MATTERS, "another head (sha256)")
    return None


def compare(a: RunFacts, b: RunFacts) -> list[Difference]:
    """Every key whose value differs, or that only one run recorded, in the sections both or either recorded."""
    out = []
    for section in sorted(a.sections.keys() | b.sections.keys()):
        sa, sb = a.sections.get(section, {}), b.sections.get(section, {})
        for key in sorted(sa.keys() | sb.keys()):
            va, vb = sa.get(key), sb.get(key)
            if va is not None and vb is not None and _same(section, va, vb):
                continue
            verdict = _in_context(a, b, section, key) or classify(section, key)
            out.append(Difference(section, key, va, vb, *verdict))
    return out


def resolve_run(client, ref: str) -> str:
    """A run id of the store: `ref` itself, else the run imported from offline id `ref` (or a prefix of it)."""
    from experiments.analysis.report.inputs import _lookup_errors
    try:
        return client.get_run(ref).info.run_id
    except _lookup_errors():
        pass
    experiments = [e.experiment_id for e in client.search_experiments()]
    op = "=" if len(ref) == 32 else "LIKE"
    runs = client.search_runs(experiments, f"tags.`specws.imported_from` {op} '{ref}{'' if op == '=' else '%'}'")
    if len(runs) != 1:
        raise LookupError(f"{ref!r}: {'no run' if not runs else f'{len(runs)} runs'} with that id or imported id")
    return runs[0].info.run_id


def diff_runs(client, run_a: str, run_b: str) -> tuple[list[Difference], RunFacts, RunFacts]:
    """The differences between two runs of `client`'s store (ids or imported ids), and what each recorded."""
    a, b = read_run(client, resolve_run(client, run_a)), read_run(client, resolve_run(client, run_b))
    return compare(a, b), a, b


def _short(value: str | None, width: int = 44) -> str:
    """A value for the table: a list of numbers as `smallest..largest (n)`, long text cut."""
    text = "not recorded" if value is None else value
    try:
        items = json.loads(text) if text.startswith("[") else None
    except ValueError:
        items = None
    if isinstance(items, list) and len(items) > 3 and all(isinstance(x, int | float) for x in items):
        return f"{min(items)}..{max(items)} ({len(items)})"
    if len(text) <= width:
        return text
    return "..." + text[3 - width:] if "/" in text else text[: width - 3] + "..."   # a path by its tail


def render(diffs: list[Difference], a: RunFacts, b: RunFacts, show_all: bool = False) -> str:
    """The differences as text: those known to matter, then not classified, then (with `show_all`, else counted)
    those of no known effect; keys only one run recorded grouped per section; sections a run lacks named."""
    lines = [f"A: {a.label}", f"B: {b.label}", _compared(diffs, a, b), ""]
    both = [d for d in diffs if d.a is not None and d.b is not None]
    for verdict in (MATTERS, UNKNOWN, NO_EFFECT):
        rows = [d for d in both if d.verdict == verdict]
        lines.append(f"{verdict} ({len(rows)}):")
        if verdict == NO_EFFECT and not show_all:
            lines.append("  " + ", ".join(f"{d.section}:{d.key}" for d in rows) if rows else "  -")
        for d in rows if verdict != NO_EFFECT or show_all else []:
            why = f"  [{d.why}]" if d.why and verdict != NO_EFFECT else ""
            lines.append(f"  {d.section:<11} {d.key:<36} A {_short(d.a)}  |  B {_short(d.b)}{why}")
        lines.append("")
    lines += _one_sided(diffs) + _missing(a, b)
    return "\n".join(lines).rstrip() + "\n"


def _compared(diffs: list[Difference], a: RunFacts, b: RunFacts) -> str:
    """`compared: engine 404 keys, 4 differ; ...` over the sections both runs recorded."""
    parts = []
    for section in sorted(a.sections.keys() & b.sections.keys()):
        keys = a.sections[section].keys() & b.sections[section].keys()
        differ = sum(1 for d in diffs if d.section == section and d.a is not None and d.b is not None)
        parts.append(f"{section} {len(keys)} keys, {differ} differ")
    return "compared: " + "; ".join(parts)


def _one_sided(diffs: list[Difference]) -> list[str]:
    out = []
    for side, pick in (("A", lambda d: d.b is None), ("B", lambda d: d.a is None)):
        rows = [d for d in diffs if pick(d)]
        for section in sorted({d.section for d in rows}):
            keys = [d.key for d in rows if d.section == section]
            shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} keys)" if len(keys) > 8 else "")
            out.append(f"recorded in {side} only, {section}: {shown}")
    return out + ([""] if out else [])


def _missing(a: RunFacts, b: RunFacts) -> list[str]:
    out = []
    for section in sorted(a.missing.keys() | b.missing.keys()):
        runs = [side for side, f in (("A", a), ("B", b)) if section in f.missing]
        why = (a.missing.get(section) or b.missing.get(section))
        out.append(f"not recorded in {' and '.join(runs)}: {section} ({why})")
    return out


def main(argv: list[str] | None = None) -> int:
    from mlflow.tracking import MlflowClient

    from experiments.config.paths import ROOT
    ap = argparse.ArgumentParser(prog="python -m experiments.analysis.diff", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs=2, metavar="RUN", help="run id, or the offline id it was imported under")
    ap.add_argument("--tracking-uri", default=f"sqlite:///{ROOT / 'mlruns/mlflow.db'}")
    ap.add_argument("--all", action="store_true", help="list the differences of no known effect too")
    args = ap.parse_args(argv)
    client = MlflowClient(args.tracking_uri)
    try:
        diffs, a, b = diff_runs(client, *args.runs)
    except LookupError as exc:
        print(f"diff refused: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render(diffs, a, b, args.all))
    return 0


if __name__ == "__main__":
    sys.exit(main())
