"""One answer per load: for each workload and load (a closed-loop concurrency level, or an open-loop arrival rate
with its concurrency cap) the configuration to deploy -- an option with its draft setting, or no speculation --
decided on the lower end of the paired speedup interval with the latency targets met
(experiments/analysis/recommend/decision.py), contiguous levels with the same choice as one range, each choice's flags
for SGLang and vLLM from the engine adapters, and what one deployment does across the range
(experiments/analysis/recommend/flags.py). How it decides and what the engines offer: docs/reference/recommend.md.

`python -m experiments.analysis.recommend <experiment name | parent run id> [--tracking-uri URI]` (or
`--experiment <experiment name | parent run id>`, as `report` takes it too)

Writes recommendation.json and .md (saying "replaced <path>" where one was there before), logs both (and SGLang's
adaptive config where a schedule needs it) to the parent run, else to the experiment's latest report run, else to a
new report run; prints the table.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.analysis.categories import ALL, category_rows
from experiments.analysis.forecast.prior import forecast_prior
from experiments.analysis.recommend.decision import Candidate, Decision, Load, Range, choice_label, collapse, decide
from experiments.analysis.recommend.flags import ADAPTIVE_FILE, choice_flags, schedule
from experiments.analysis.report.inputs import (
    CONTAMINATED,
    Records,
    ReportInputError,
    config_key,
    contamination_of,
    pooled_records,
    run_acceptor,
    select_runs,
)
from experiments.analysis.runs import run_config
from experiments.analysis.slo import slo_levels
from experiments.analysis.stats import Interval, prompt_totals


@dataclass
class Recommendation:
    """One workload's answer: a decision per load, the ranges they collapse into, the flags of every choice and the
    closed-loop schedule."""
    workload: str
    prompt_set: str | None
    slo: dict[str, float]
    decisions: list[Decision]
    excluded: dict[str, str] = field(default_factory=dict)     # configuration -> why it was not considered

    @property
    def ranges(self) -> list[Range]:
        return collapse(self.decisions)

    def choices(self) -> dict[str, Candidate | None]:
        out: dict[str, Candidate | None] = {}
        for d in self.decisions:
            out[d.choice] = next((c for c in d.candidates if c.label == d.choice), None)
        return out

    def closed_schedule(self) -> dict[str, Any]:
        closed = [r for r in self.ranges if r.decisions[0].load.closed]
        spans = [(r.decisions[0].load.concurrency, r.decisions[-1].load.concurrency,
                  self.choices()[r.decisions[0].choice]) for r in closed]
        return schedule(spans, [d for r in closed for d in r.decisions])

    def as_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "prompt_set": self.prompt_set, "slo": self.slo,
                "summary": "; ".join(r.text for r in self.ranges), "ranges": [r.as_dict() for r in self.ranges],
                "loads": [d.as_dict() for d in self.decisions],
                "flags": {label: choice_flags(None if c is None else c.spec) for label, c in self.choices().items()},
                "schedule": self.closed_schedule(), "excluded": self.excluded}


def _candidates(runs: list, records: Records, label: str, config: str) -> list[tuple[Load, Candidate]]:
    """One candidate per level the runs (one configuration, one load kind) measured, pooled over the runs."""
    cfg = run_config(runs[0])
    opt, base = pooled_records(runs, records)
    raw = [r for run in runs for r in records(run.info.run_id)]
    slo = slo_levels(opt, base, cfg.slo_targets, cfg.closed)
    out = []
    for row in category_rows(opt, base, run_acceptor(runs[0])):
        if row["category"] != ALL or not row["n_prompts"]:
            continue
        c = row["concurrency"]
        iv = Interval(row["speedup"], row["speedup_low"], row["speedup_high"], row["n_prompts"], row["method"])
        totals = prompt_totals([r for r in raw if r["concurrency"] == c])
        out.append((Load(cfg.arrival, cfg.rate, c),
                    Candidate(label, config, cfg.option or "?", cfg.engine, dataclasses.asdict(cfg.spec), iv, totals,
                              slo.get(c), [run.info.run_id for run in runs])))
    return out


def _grouped(options: list, by_id: dict) -> dict[tuple, list]:
    """(workload, prompt set, configuration, arrival, rate) -> the option runs measuring it with a stored baseline."""
    groups: dict[tuple, list] = defaultdict(list)
    for run in options:
        if run.data.tags["specws.baseline_run_id"] in by_id:
            cfg = run_config(run)
            label, workload = config_key(run)
            groups[(workload, cfg.prompt_set, label, cfg.arrival, cfg.rate)].append(run)
    return groups


def _names(groups: dict[tuple, list]) -> dict[str, str]:
    """configuration label -> its short name ("A k=4"), unless two configurations share that name (e.g. two
    n-gram windows): then the configuration label itself."""
    short = {label: choice_label(run_config(runs[0])) for (_, _, label, *_), runs in groups.items()}
    count = Counter(short.values())
    return {label: name if count[name] == 1 else label for label, name in short.items()}


def build(client: Any, options: list, all_runs: list, records: Records | None = None) -> list[Recommendation]:
    """A recommendation per workload over the option runs `options` (their baselines among `all_runs`)."""
    records = records or Records(client)
    by_workload: dict[tuple, dict[Load, list[Candidate]]] = defaultdict(lambda: defaultdict(list))
    meta: dict[tuple, dict] = defaultdict(lambda: {"slo": {}, "excluded": {}})
    groups = _grouped(options, {r.info.run_id: r for r in all_runs})
    names = _names(groups)
    for (workload, prompt_set, label, *_), runs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        key = (workload, prompt_set)
        flags = {contamination_of(run, records(run.info.run_id)) for run in runs}
        if any(f.startswith("contaminated") for f in flags):
            meta[key]["excluded"][label] = f"{CONTAMINATED}: {'; '.join(sorted(flags))}"[:500]
            continue
        meta[key]["slo"] |= run_config(runs[0]).slo_targets
        for ld, cand in _candidates(runs, records, names[label], label):
            by_workload[key][ld].append(cand)
    out = []
    for key in sorted(set(by_workload) | set(meta), key=str):
        decisions = [decide(ld, cs) for ld, cs in sorted(by_workload[key].items())]
        out.append(Recommendation(*key, meta[key]["slo"], decisions, meta[key]["excluded"]))
    return out


def _log_to(client: Any, exp_id: str, parent, stem: str):
    """The run the recommendation goes onto: the sweep's parent, else the experiment's latest report run, else a
    new report run (as the report does); returns (run id, None) or (None, the new run's name)."""
    if parent is not None:
        return parent.info.run_id, None
    found = client.search_runs([exp_id], "tags.`specws.mode` = 'report'", order_by=["attributes.start_time DESC"],
                               max_results=1)
    return (found[0].info.run_id, None) if found else (None, f"recommend-{stem}"[:250])


def log_recommendation(client: Any, run_id: str, recs: list[Recommendation], json_path: Path, md_path: Path,
                       folder: str = "recommendation") -> None:
    client.log_artifact(run_id, str(json_path), folder)
    client.log_artifact(run_id, str(md_path), folder)
    for rec in recs:
        sg = rec.closed_schedule().get("sglang") or {}
        if sg.get("config"):
            client.log_dict(run_id, sg["config"], f"{folder}/{rec.prompt_set or rec.workload}-{ADAPTIVE_FILE}")


def write(recs: list[Recommendation], out: Path, stem: str, title: str) -> tuple[Path, Path]:
    import json

    from experiments.analysis.recommend.render import markdown
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"recommendation-{stem}.json", out / f"recommendation-{stem}.md"
    json_path.write_text(json.dumps({"title": title, "workloads": [r.as_dict() for r in recs]}, indent=1,
                                    default=str))
    md_path.write_text(markdown(recs, title))
    return json_path, md_path


def main(argv: list[str] | None = None) -> int:
    from experiments.analysis.report.inputs import add_target, iso, since_ms, target_of
    from experiments.config.paths import ROOT
    from experiments.tracking.lifecycle import tracked_run
    from experiments.tracking.offline_store import client_for
    ap = argparse.ArgumentParser(prog="python -m experiments.analysis.recommend", description=__doc__.split("\n\n")[0])
    add_target(ap)
    ap.add_argument("--tracking-uri", default=f"sqlite:///{ROOT / 'mlruns/mlflow.db'}", help="or offline://DIR")
    ap.add_argument("--out", type=Path, default=ROOT / "mlruns" / "reports")
    ap.add_argument("--since", type=since_ms, default=None, metavar="ISO-TIME", help="only runs started since then")
    args = ap.parse_args(argv)
    args.experiment = target_of(ap, args)
    client = client_for(args.tracking_uri)   # offline://DIR: the H200 host's store, no MLflow there
    try:
        options, all_runs, exp_id, parent = select_runs(client, args.experiment, args.since)
    except ReportInputError as exc:
        print(f"recommend refused: {exc}", file=sys.stderr)
        return 2
    recs = build(client, options, all_runs)
    for (workload, label), line in forecast_prior(client, exp_id, options).items():
        for rec in (r for r in recs if r.workload == workload):
            rec.excluded[f"{label} (forecast only)"] = line
    stem = args.experiment.replace("/", "_").replace("@", "_")
    title = f"Recommendation: {args.experiment}" + ("" if args.since is None else f", runs since {iso(args.since)}")
    before = {p for p in (args.out / f"recommendation-{stem}.json", args.out / f"recommendation-{stem}.md")
              if p.exists()}
    json_path, md_path = write(recs, args.out, stem, title)
    for path in sorted(before):
        print(f"replaced {path}", file=sys.stderr)
    run_id, new_name = _log_to(client, exp_id, parent, stem)
    if run_id is not None:
        log_recommendation(client, run_id, recs, json_path, md_path)
    else:
        with tracked_run(client, exp_id, new_name, {"specws.mode": "report"}) as run:
            log_recommendation(client, run.id, recs, json_path, md_path)
    print(md_path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
