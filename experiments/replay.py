"""Offline n-gram (prompt-lookup) replay: the acceptance vLLM's n-gram speculation would get on recorded
greedy outputs, for any grid of (min_match, max_match, draft tokens), without an engine.

`python -m experiments.replay <run-id | records.jsonl> [min_match=1,2] [max_match=2,4] [k=1,2,4,8]`

The proposer is vLLM's `_find_longest_matched_ngram_and_propose_tokens` (v1/spec_decode/ngram_proposer.py):
over the context (prompt + output so far) take the longest suffix of length L <= max_match that occurs
earlier with at least one token after it; below min_match there is no draft. Among occurrences of that
suffix it copies the tokens after the *earliest* one, at most k and at most up to the end of the context.
A step verifies the draft against the recorded greedy continuation; it emits the accepted prefix plus one
token. The first output token comes from prefill, without a draft.

Every position of a workload is solved at once: n-gram ids per length (np.unique over packed keys, the
request index in the key keeps matches inside a request), the earliest occurrence of each id, then the
draft and its accepted length at every position; only the jump from step to step is a Python loop.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from itertools import product
from pathlib import Path

import numpy as np

from experiments.engines.base import Acceptance, acceptance_from_positions

DEFAULT_GRID = {"min_match": [1, 2, 3], "max_match": [2, 3, 4, 5], "k": [1, 2, 4, 6, 8]}
DEFAULT_MAX_MODEL_LEN = 2048


class ReplayInputError(ValueError):
    """Input that cannot be replayed; nothing was written to the store."""


@dataclass(frozen=True)
class NgramConfig:
    min_match: int
    max_match: int
    k: int

    @property
    def label(self) -> str:
        return f"min{self.min_match}_max{self.max_match}_k{self.k}"


@dataclass
class ReplaySequence:
    prompt_ids: list[int]
    output_ids: list[int]
    prompt_id: str = ""
    concurrency: int = 0
    repetition: int = 0
    chunk_tokens: list[int] = field(default_factory=list)


@dataclass
class ReplayStats:
    """Counters in vLLM's terms; `accepted_upper` also counts draft tokens past the recorded end as
    accepted (the engine compares them with tokens the record does not have)."""
    steps: int = 0                  # decode steps after prefill
    drafts: int = 0                 # steps that carried a draft
    draft_tokens: int = 0
    accepted: int = 0
    accepted_upper: int = 0
    output_tokens: int = 0
    decode_tokens: int = 0          # output tokens after the first (which prefill emits)
    per_pos: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)  # tokens per step, prefill's first token included

    def add(self, other: ReplayStats) -> None:
        self.steps += other.steps
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted += other.accepted
        self.accepted_upper += other.accepted_upper
        self.output_tokens += other.output_tokens
        self.decode_tokens += other.decode_tokens
        if len(other.per_pos) > len(self.per_pos):
            self.per_pos += [0] * (len(other.per_pos) - len(self.per_pos))
        for i, c in enumerate(other.per_pos):
            self.per_pos[i] += c

    def acceptance(self) -> Acceptance | None:
        return acceptance_from_positions(self.drafts, self.draft_tokens, self.accepted,
                                         [float(c) for c in self.per_pos])

    def metrics(self) -> dict[str, float]:
        acc = self.acceptance()
        out = {"steps": float(self.steps), "drafts": float(self.drafts),
               "draft_tokens": float(self.draft_tokens), "accepted": float(self.accepted),
               "accepted_upper": float(self.accepted_upper),
               "steps_with_draft": self.drafts / self.steps if self.steps else 0.0,
               # tokens per decode step, steps without a draft included: what throughput sees
               "tokens_per_step": self.decode_tokens / self.steps if self.steps else 1.0}
        if acc is not None:
            out |= {"accept_length": acc.accept_length, "acceptance_rate": acc.acceptance_rate}
            out |= {f"accept_pos_{i}": p for i, p in enumerate(acc.per_position)}
        return out


class NgramIndex:
    """The workload's tokens (prompt + output per request, concatenated) and, per n-gram length L,
    the id of the L-gram starting at every position and the earliest position of each id."""

    def __init__(self, sequences: list[ReplaySequence], max_len: int):
        lengths = np.array([len(s.prompt_ids) + len(s.output_ids) for s in sequences], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self.ends = self.starts + lengths
        self.prompt_lens = np.array([len(s.prompt_ids) for s in sequences], dtype=np.int64)
        self.tokens = np.fromiter((t for s in sequences for t in (*s.prompt_ids, *s.output_ids)),
                                  dtype=np.int64, count=int(lengths.sum()))
        self.request = np.repeat(np.arange(len(sequences), dtype=np.int64), lengths)
        self.req_start = self.starts[self.request]
        self.req_end = self.ends[self.request]
        self.ids: list[np.ndarray] = []     # ids[L-1][j]: id of tokens[j:j+L]
        self.first: list[np.ndarray] = []   # first[L-1][id]: earliest j with that id
        self.extend(max_len)

    def extend(self, max_len: int) -> None:
        n = len(self.tokens)
        if not self.ids and n:
            vocab = int(self.tokens.max()) + 1
            uniq, first, inv = np.unique(self.request * vocab + self.tokens, return_index=True,
                                         return_inverse=True)
            self.ids.append(inv.astype(np.int64))
            self.first.append(first.astype(np.int64))
            self._unigram_count = len(uniq)
        while len(self.ids) < max_len and n:
            prev, unigram = self.ids[-1], self.ids[0]
            length = len(self.ids) + 1
            # windows running past the array end get a key no real window has
            tail = np.concatenate([unigram[length - 1:], np.full(length - 1, self._unigram_count)])
            _, first, inv = np.unique(prev * (self._unigram_count + 1) + tail, return_index=True,
                                      return_inverse=True)
            self.ids.append(inv.astype(np.int64))
            self.first.append(first.astype(np.int64))

    def proposals(self, cfg: NgramConfig, max_model_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(draft start, draft length) for a context ending before every position n (length 0: none)."""
        self.extend(cfg.max_match)
        n = np.arange(len(self.tokens), dtype=np.int64)
        best = np.zeros(len(n), dtype=np.int64)
        start = np.zeros(len(n), dtype=np.int64)
        for length in range(1, cfg.max_match + 1):
            j = n - length
            inside = j >= self.req_start
            jj = np.where(inside, j, 0)
            earliest = self.first[length - 1][self.ids[length - 1][jj]]
            found = inside & (earliest < jj)   # an occurrence before the suffix itself
            best = np.where(found, length, best)
            start = np.where(found, earliest + length, start)
        context = n - self.req_start
        room = np.minimum(n - start, max_model_len - context)
        draft_len = np.where(best >= cfg.min_match, np.clip(np.minimum(cfg.k, room), 0, None), 0)
        return start, draft_len

    def accepted(self, start: np.ndarray, draft_len: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Accepted draft tokens at every position (recorded tokens only) and the upper bound that also
        accepts draft tokens past the recorded end when everything before them matched."""
        n = np.arange(len(self.tokens), dtype=np.int64)
        left = self.req_end - n
        ok = np.ones(len(n), dtype=bool)
        acc = np.zeros(len(n), dtype=np.int64)
        last = len(self.tokens) - 1
        for i in range(k):
            ok &= (i < draft_len) & (i < left)
            ok &= self.tokens[np.minimum(start + i, last)] == self.tokens[np.minimum(n + i, last)]
            acc += ok
        upper = np.where((acc == np.minimum(left, draft_len)) & (draft_len > left), draft_len, acc)
        return acc, upper


def replay_config(index: NgramIndex, cfg: NgramConfig, max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                  keep_emitted: bool = False) -> list[ReplayStats]:
    """Per-request counters for one configuration."""
    start, draft_len = index.proposals(cfg, max_model_len)
    acc, upper = index.accepted(start, draft_len, cfg.k)
    jump = np.where(draft_len > 0, acc + 1, 1).tolist()
    out = []
    for r in range(len(index.starts)):
        pos, end = int(index.starts[r] + index.prompt_lens[r]) + 1, int(index.ends[r])
        visited = []
        while pos < end:
            visited.append(pos)
            pos += jump[pos]
        v = np.asarray(visited, dtype=np.int64)
        drafted = v[draft_len[v] > 0]
        a = acc[drafted]
        stats = ReplayStats(steps=len(v), drafts=len(drafted), draft_tokens=int(draft_len[drafted].sum()),
                            accepted=int(a.sum()), accepted_upper=int(upper[drafted].sum()),
                            output_tokens=end - int(index.starts[r] + index.prompt_lens[r]),
                            decode_tokens=max(0, end - int(index.starts[r] + index.prompt_lens[r]) - 1),
                            per_pos=np.bincount(a, minlength=cfg.k + 1)[::-1].cumsum()[::-1][1:].tolist())
        if keep_emitted and stats.output_tokens:
            stats.emitted = [1, *np.minimum(np.asarray(jump)[v], end - v).tolist()]
        out.append(stats)
    return out


def total(stats: list[ReplayStats]) -> ReplayStats:
    agg = ReplayStats()
    for s in stats:
        agg.add(s)
    return agg


# ---------------------------------------------------------------- inputs

def sequences_from_records(records: list[dict], origin: str) -> list[ReplaySequence]:
    """Finished requests of a records file; refuses records that lack token ids or an empty workload."""
    if not records:
        raise ReplayInputError(f"{origin}: no request records (empty workload)")
    missing = [i for i, r in enumerate(records) if not isinstance(r.get("prompt_token_ids"), list)
               or not isinstance(r.get("output_token_ids"), list) or not r.get("prompt_token_ids")]
    if missing:
        raise ReplayInputError(f"{origin}: {len(missing)} of {len(records)} records carry no prompt/output token "
                               f"ids (first: line {missing[0] + 1}); replay needs prompt_token_ids and "
                               "output_token_ids as written by experiments/client.py")
    ok = [r for r in records if not r.get("error") and r["output_token_ids"]]
    if not ok:
        raise ReplayInputError(f"{origin}: none of the {len(records)} requests finished with output tokens")
    return [ReplaySequence([int(t) for t in r["prompt_token_ids"]], [int(t) for t in r["output_token_ids"]],
                           str(r.get("prompt_id", i)), int(r.get("concurrency", 0)), int(r.get("repetition", 0)),
                           list(r.get("chunk_tokens") or []))
            for i, r in enumerate(ok)]


def read_records_file(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise ReplayInputError(f"{path}: not JSON lines ({exc})") from exc


@dataclass
class Source:
    sequences: list[ReplaySequence]
    label: str
    run: object | None = None        # mlflow Run when the records came from the store


def load_source(source: str, client) -> Source:
    """A records file (or folder of them) or an MLflow run id whose `records/` artifacts are replayed."""
    path = Path(source)
    if path.exists():
        files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
        records = [r for f in files for r in read_records_file(f)]
        return Source(sequences_from_records(records, str(path)), path.name)
    from mlflow.exceptions import MlflowException
    try:
        run = client.get_run(source)
    except MlflowException as exc:
        raise ReplayInputError(f"{source!r} is neither a records file nor a run in {client.tracking_uri}") from exc
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = Path(client.download_artifacts(run.info.run_id, "records", tmp))
        except (MlflowException, OSError) as exc:
            raise ReplayInputError(f"run {source} has no records/ artifact to replay") from exc
        records = [r for f in sorted(local.glob("*.jsonl")) for r in read_records_file(f)]
    return Source(sequences_from_records(records, f"run {source}"), run.info.run_name or source, run)


def parse_grid(overrides: list[str]) -> list[NgramConfig]:
    grid = {k: list(v) for k, v in DEFAULT_GRID.items()}
    aliases = {"num_draft_tokens": "k", "min": "min_match", "max": "max_match"}
    for item in overrides:
        key, sep, values = item.partition("=")
        key = aliases.get(key, key)
        if not sep or key not in grid:
            raise ReplayInputError(f"grid override {item!r}: expected key=v1,v2 with key in {sorted(grid)}")
        try:
            grid[key] = [int(v) for v in values.split(",") if v]
        except ValueError as exc:
            raise ReplayInputError(f"grid override {item!r}: values must be integers") from exc
        if not grid[key] or min(grid[key]) < 1:
            raise ReplayInputError(f"grid override {item!r}: values must be integers >= 1")
    configs = [NgramConfig(a, b, k) for a, b, k in product(grid["min_match"], grid["max_match"], grid["k"]) if a <= b]
    if not configs:
        raise ReplayInputError("the grid has no configuration with min_match <= max_match")
    return configs


# ---------------------------------------------------------------- replay of a workload

def replay_workload(seqs: list[ReplaySequence], configs: list[NgramConfig],
                    max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> dict[NgramConfig, dict]:
    """Per configuration: workload totals, per concurrency level, per request."""
    index = NgramIndex(seqs, max(c.max_match for c in configs))
    out = {}
    for cfg in configs:
        per_request = replay_config(index, cfg, max_model_len)
        levels: dict[int, ReplayStats] = {}
        for seq, stats in zip(seqs, per_request, strict=True):
            levels.setdefault(seq.concurrency, ReplayStats()).add(stats)
        out[cfg] = {"total": total(per_request), "levels": levels,
                    "requests": [(s.prompt_id, s.concurrency, s.repetition, st)
                                 for s, st in zip(seqs, per_request, strict=True)]}
    return out


def engine_config(run) -> tuple[NgramConfig, int] | None:
    """The n-gram configuration a measured vLLM run served, or None when it was no vLLM n-gram run."""
    p = run.data.params
    if p.get("spec.method") != "ngram" or p.get("engine.name") != "vllm":
        return None
    cfg = NgramConfig(int(p["spec.ngram.min_match"]), int(p["spec.ngram.max_match"]), int(p["spec.num_draft_tokens"]))
    return cfg, int(p.get("model.max_model_len") or DEFAULT_MAX_MODEL_LEN)


def agreement(run, result: dict, seqs: list[ReplaySequence]) -> dict[str, float]:
    """Replay vs the engine's Prometheus counters (whole window) and, where the client saw one chunk per
    engine step, the per-step emitted tokens."""
    m = run.data.metrics
    rep = result["total"]
    acc = rep.acceptance()
    out = {"replay_drafts": rep.drafts, "replay_accepted": rep.accepted, "replay_accepted_upper": rep.accepted_upper,
           "replay_draft_tokens": rep.draft_tokens}
    if acc is not None:
        out |= {"replay_accept_length": acc.accept_length, "replay_acceptance_rate": acc.acceptance_rate}
        out |= {f"replay_accept_pos_{i}": p for i, p in enumerate(acc.per_position)}
    for key in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "accept_length", "acceptance_rate"):
        if key in m:
            out[f"engine_{key}"] = m[key]
    if "accept_length" in m and acc is not None:
        out["accept_length_abs_error"] = abs(acc.accept_length - m["accept_length"])
    if m.get("spec_drafts"):
        out["drafts_rel_error"] = abs(rep.drafts - m["spec_drafts"]) / m["spec_drafts"]
    for i in range(len(rep.per_pos)):
        if f"accept_pos_{i}" in m and acc is not None:
            out[f"accept_pos_{i}_abs_error"] = abs(acc.per_position[i] - m[f"accept_pos_{i}"])
    for c, stats in result["levels"].items():
        la = stats.acceptance()
        if la is not None and f"accept_length_c{c}" in m:
            out[f"accept_length_c{c}_abs_error"] = abs(la.accept_length - m[f"accept_length_c{c}"])
    # single stream: every streamed chunk is one engine step, so the step sequence itself can be compared
    index = NgramIndex(seqs, result["config"].max_match)
    per_request = replay_config(index, result["config"], result["max_model_len"], keep_emitted=True)
    singles = [(s, st) for s, st in zip(seqs, per_request, strict=True) if s.concurrency == 1 and s.chunk_tokens]
    if singles:
        same = sum(s.chunk_tokens == st.emitted for s, st in singles)
        out["c1_requests_step_sequence_exact"] = same / len(singles)
    return out


# ---------------------------------------------------------------- MLflow

def heatmap(results: dict[NgramConfig, dict]):
    """Accept length (per drafted step, vLLM's definition) and tokens per decode step over the grid:
    one panel column per min_match, rows max_match, columns draft tokens k."""
    from experiments.plots import plt
    mins = sorted({c.min_match for c in results})
    maxs = sorted({c.max_match for c in results})
    ks = sorted({c.k for c in results})
    fig, axes = plt.subplots(2, len(mins), figsize=(1.2 + 0.7 * len(ks) * len(mins) + 1.5 * len(mins), 7),
                             squeeze=False)
    for row, (key, title) in enumerate((("accept_length", "accept length (drafted steps)"),
                                        ("tokens_per_step", "tokens per decode step (all steps)"))):
        for col, mn in enumerate(mins):
            grid = np.full((len(maxs), len(ks)), np.nan)
            for c, r in results.items():
                if c.min_match == mn:
                    grid[maxs.index(c.max_match), ks.index(c.k)] = r["total"].metrics().get(key, np.nan)
            ax = axes[row][col]
            im = ax.imshow(grid, origin="lower", cmap="viridis", aspect="auto")
            for (i, j), v in np.ndenumerate(grid):
                if not np.isnan(v):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w", fontsize=8)
            ax.set_xticks(range(len(ks)), [str(k) for k in ks])
            ax.set_yticks(range(len(maxs)), [str(m) for m in maxs])
            ax.set_xlabel("draft tokens k")
            ax.set_ylabel("max_match")
            ax.set_title(f"{title}\nmin_match={mn}", fontsize=9)
            fig.colorbar(im, ax=ax, shrink=0.8)
    fig.tight_layout()
    return fig


def to_json(results: dict[NgramConfig, dict]) -> dict:
    return {c.label: {"config": asdict(c), "total": r["total"].metrics(),
                      "levels": {str(lv): s.metrics() for lv, s in r["levels"].items()},
                      "requests": [{"prompt_id": p, "concurrency": lv, "repetition": rep,
                                    **{k: v for k, v in asdict(s).items() if k != "emitted"}}
                                   for p, lv, rep, s in r["requests"]]}
            for c, r in results.items()}


def log_replay(client, experiment_id: str, source: Source, source_ref: str, configs: list[NgramConfig],
               results: dict, engine_cmp: dict[str, float], max_model_len: int) -> str:
    """Created only now, with everything computed: a failure before this point leaves no run behind."""
    import mlflow
    tags = {"mlflow.runName": f"replay-{source.label}"[:250], "specws.mode": "replay",
            "specws.replay_of": source_ref}
    if source.run is not None:
        for key in ("specws.workload", "specws.model", "specws.site", "specws.option"):
            if key in source.run.data.tags:
                tags[key] = source.run.data.tags[key]
    run = client.create_run(experiment_id, tags=tags)
    rid = run.info.run_id
    try:
        grid = {key: sorted({getattr(c, key) for c in configs}) for key in ("min_match", "max_match", "k")}
        params = {f"grid.{k}": ",".join(map(str, v)) for k, v in grid.items()}
        params |= {"source": source_ref, "max_model_len": str(max_model_len), "requests": str(len(source.sequences))}
        metrics = dict(engine_cmp)
        for c, r in results.items():
            metrics |= {f"{c.label}/{k}": v for k, v in r["total"].metrics().items()
                        if k in ("accept_length", "acceptance_rate", "tokens_per_step", "steps_with_draft")}
        best = max(results, key=lambda c: results[c]["total"].metrics()["tokens_per_step"])
        params |= {"best_config": best.label}
        metrics["best_tokens_per_step"] = results[best]["total"].metrics()["tokens_per_step"]
        client.log_batch(rid, params=[mlflow.entities.Param(k, v) for k, v in params.items()])
        items = [mlflow.entities.Metric(k, float(v), 0, 0) for k, v in metrics.items()]
        for i in range(0, len(items), 500):
            client.log_batch(rid, metrics=items[i: i + 500])
        client.log_dict(rid, to_json(results), "replay.json")
        client.log_figure(rid, heatmap(results), "plots/replay_heatmap.png")
        client.set_terminated(rid, "FINISHED")
    except BaseException:
        client.set_terminated(rid, "FAILED")
        raise
    return rid


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from experiments.paths import ROOT
    parser = argparse.ArgumentParser(prog="python -m experiments.replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="MLflow run id (its records/ artifacts) or a records .jsonl file / folder")
    parser.add_argument("grid", nargs="*", help=f"min_match=1,2 max_match=2,4 k=1,2,4,8 (defaults: {DEFAULT_GRID})")
    parser.add_argument("--tracking-uri", default=f"sqlite:///{ROOT / 'mlruns/mlflow.db'}")
    parser.add_argument("--experiment", default=None, help="default: the source run's experiment, else 'replay'")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-log", action="store_true", help="print only; write nothing to the store")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    import mlflow
    from mlflow.tracking import MlflowClient
    mlflow.set_tracking_uri(args.tracking_uri)
    client = MlflowClient()
    try:
        configs = parse_grid(args.grid)
        source = load_source(args.source, client)
    except ReplayInputError as exc:
        console.print(f"[bold red]replay refused:[/] {exc}")
        return 2
    served = engine_config(source.run) if source.run is not None else None
    max_model_len = args.max_model_len or (served[1] if served else DEFAULT_MAX_MODEL_LEN)
    if served and served[0] not in configs:
        configs.append(served[0])
    results = replay_workload(source.sequences, configs, max_model_len)
    engine_cmp: dict[str, float] = {}
    if served:
        res = results[served[0]] | {"config": served[0], "max_model_len": max_model_len}
        engine_cmp = agreement(source.run, res, source.sequences)
        console.print(f"engine config {served[0].label}: " + ", ".join(f"{k}={v:.4g}" for k, v in engine_cmp.items()))
    for c in sorted(results, key=lambda c: -results[c]["total"].metrics()["tokens_per_step"])[:10]:
        m = results[c]["total"].metrics()
        console.print(f"{c.label:>20}: accept_length={m.get('accept_length', float('nan')):.3f} "
                      f"tokens/step={m['tokens_per_step']:.3f} steps_with_draft={m['steps_with_draft']:.2f}")
    if args.no_log:
        return 0
    if args.experiment:
        exp = client.get_experiment_by_name(args.experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(args.experiment)
    elif source.run is not None:
        exp_id = source.run.info.experiment_id
    else:
        exp = client.get_experiment_by_name("replay")
        exp_id = exp.experiment_id if exp else client.create_experiment("replay")
    ref = source.run.info.run_id if source.run is not None else str(Path(args.source).resolve())
    rid = log_replay(client, exp_id, source, ref, configs, results, engine_cmp, max_model_len)
    console.print(f"replay run {rid} ({len(configs)} configurations, {len(source.sequences)} requests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
