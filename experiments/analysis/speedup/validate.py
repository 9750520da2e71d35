"""The forecast validated on every clean recorded option run in the repository, leave one lease out:

    python -m experiments.analysis.speedup.validate [--journal docs/journal] [--write FILE] [--json FILE]

Each lease's store (`runs.tar.xz` under docs/journal/, one per lease, or `runs.tar.gz` as a lease writes it; a
lease's `probe.tar.xz` feeds step costs only) is opened as an offline store. For every finished option run whose
contamination check is clean and whose paired baseline is in the same lease, the forecast
(experiments/analysis/speedup/forecast.py) is made from what existed before it ran: the baseline's records, the
acceptance offline on the baseline's outputs, and a step-cost profile fitted on the same engine, model and site in
the *other* leases only. It is compared with the paired speedup the run measured (with its 95 % interval). Prints one
row per run and level, then the mean |error| and the verdict agreement over the levels the measurement decides
(interval clear of 1).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from experiments.analysis.categories import accept_length_of, acceptor
from experiments.analysis.contamination import check_contamination
from experiments.analysis.runs import run_config
from experiments.analysis.speedup.forecast import ForecastUnavailable, HostOutsideProfile, forecast
from experiments.analysis.speedup.offline_acceptance import AcceptanceUnavailable, RequestSteps, offline_steps
from experiments.analysis.speedup.stepcost import (
    PROFILES,
    StepCostProfile,
    fit_profile,
    key_of,
    level_steps,
    save_profile,
)
from experiments.analysis.stats import UNCLEAR, records_speedup, verdict
from experiments.config.paths import ROOT, cache_dir
from experiments.tracking.import_runs import archive_stem, offline_folder, store_archive
from experiments.tracking.offline_store import OfflineClient
from experiments.tracking.records import run_records

MEASURED = "tags.`specws.mode` = 'measure' and attributes.status = 'FINISHED'"
COMMITTED_HEADS = ROOT / "experiments" / "eagle3" / "artifacts"
STORE_STEMS = ("runs", "probe")


@dataclass
class Lease:
    name: str
    folder: Path                       # the journal folder the store came from
    client: OfflineClient
    runs: list = field(default_factory=list)
    probe_only: bool = False           # a probe store: step costs, never a validation row


def open_store(tarball: Path, name: str) -> OfflineClient:
    """The lease's store, unpacked and checked by the importer's `offline_folder` into the validation cache once per
    archive version."""
    dest = cache_dir() / "validation" / name
    marker = dest / ".from"
    stamp = f"{tarball.resolve()} {tarball.stat().st_mtime_ns}"
    if not marker.exists() or marker.read_text() != stamp:
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        root = offline_folder(tarball, dest)
        marker.write_text(stamp)
        return OfflineClient(root)
    return OfflineClient(offline_folder(dest, dest))


def store_archives(journal: Path) -> list[Path]:
    """Every lease's `runs` and `probe` store under `journal`, one per folder and stem (.tar.xz before .tar.gz)."""
    found = {(p.parent, archive_stem(p)) for p in journal.rglob("*.tar.*") if archive_stem(p) in STORE_STEMS}
    return sorted(store_archive(folder, stem) for folder, stem in found)


def leases(journal: Path) -> list[Lease]:
    out = []
    for tarball in store_archives(journal):
        folder, probe = tarball.parent, archive_stem(tarball) == "probe"
        name = str(folder.relative_to(journal)).replace("/", "_") + ("-probe" if probe else "")
        client = open_store(tarball, name)
        runs = [client.get_run(i) for i in client.run_ids()]
        measured = [r for r in runs if r.data.tags.get("specws.mode") == "measure" and r.info.status == "FINISHED"]
        out.append(Lease(name, folder, client, measured, probe))
    return out


def lease_group(run) -> tuple[str, str, str]:
    key = key_of(run)
    return key.engine, key.model, key.site


def local_model(params: dict[str, str]) -> str | None:
    """The target's weights here: the cache's folder of the same name as the run's model path."""
    path = cache_dir() / "models" / Path(params.get("model.path") or "").name
    return str(path) if (path / "config.json").exists() else None


def local_head(lease: Lease, params: dict[str, str]) -> str | None:
    """The head a lease served, here: the committed head by name, or a lease's own head whose metadata
    (specws_eagle3.json in the lease's journal folder) equals a committed head's; else None."""
    name = Path(params.get("spec.draft_model") or "").name
    for committed in COMMITTED_HEADS.iterdir():
        same_name = name in (committed.name, f"{committed.name}-sglang")
        meta = lease.folder / "specws_eagle3.json"
        same_meta = meta.exists() and json.loads(meta.read_text()) == json.loads(
            (committed / "specws_eagle3.json").read_text())
        if same_name or same_meta:
            local = cache_dir() / "eagle3" / "heads" / (committed.name + ("-sglang" if name.endswith("-sglang")
                                                                          else ""))
            return str(local) if (local / "config.json").exists() else None
    return None


def contamination(client, run, records: list[dict]) -> str:
    tag = run.data.tags.get("specws.contamination")
    if tag:
        return tag
    check = check_contamination(records, accept_length_of(acceptor(run_config(run).engine)))
    return check.as_tag()


VARIANTS = (("base", "other leases"), ("ms", "other leases"), ("base", "same lease"), ("ms", "same lease"))


def validation_rows(all_leases: list[Lease]) -> tuple[list[dict], list[dict]]:
    """(rows per run, level and variant (unit of the step costs, where they were fitted), runs or variants not
    forecast with the reason)."""
    steps_by_lease = {lz.name: level_steps(lz.client, lz.runs, lz.name) for lz in all_leases}
    rows, skipped = [], []
    for lease in all_leases:
        if lease.probe_only:
            continue
        by_id = {r.info.run_id: r for r in lease.runs}
        for run in lease.runs:
            config = run_config(run)
            if not config.spec.speculative:
                continue
            row = {"lease": lease.name, "run": run.info.run_id[:8], "option": config.option,
                   "workload": config.workload, "method": config.spec.method,
                   "k": config.spec.num_draft_tokens if config.spec.method == "ngram" else config.spec.num_steps}
            try:
                inputs = run_inputs(lease, run, by_id)
            except (ForecastUnavailable, AcceptanceUnavailable) as exc:
                skipped.append(row | {"reason": str(exc)})
                continue
            for unit, scope in VARIANTS:
                variant = row | {"unit": unit, "scope": scope}
                try:
                    profile = variant_profile(lease, run, all_leases, steps_by_lease, unit, scope)
                    rows += forecast_rows(inputs, profile, variant)
                except ForecastUnavailable as exc:
                    skipped.append(variant | {"reason": str(exc),
                                              "outside": isinstance(exc, HostOutsideProfile)})
    return rows, skipped


def cached_steps(lease: str, baseline_id: str, config, params: dict[str, str], records: list[dict]) -> list:
    """The offline acceptance of one baseline under one speculation, kept on disk beside the extracted store (a
    head's evaluation takes ~30 s on the CPU; the lease's records never change)."""
    key = hashlib.sha256(repr((baseline_id, config.spec, config.engine)).encode()).hexdigest()[:16]
    path = cache_dir() / "validation" / "offline" / lease / f"{key}.json"
    if path.exists():
        return [RequestSteps(**s) for s in json.loads(path.read_text())]
    steps = offline_steps(records, config, params)[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(s) for s in steps]))
    return steps


@dataclass
class RunInputs:
    """What a forecast of one measured run may use (its baseline's records and the offline acceptance), and what it
    is checked against (the run's own records)."""
    run: object
    base: object
    records: list[dict]
    base_records: list[dict]
    config: object
    steps: list


def run_inputs(lease: Lease, run, by_id: dict) -> RunInputs:
    config = run_config(run)
    if config.arrival != "closed":
        raise ForecastUnavailable("open-loop arrivals: the forecast models closed-loop levels")
    base = by_id.get(config.baseline_run_id or "")
    if base is None:
        raise ForecastUnavailable("its paired baseline is not in the lease's store")
    records, base_records = run_records(lease.client, run.info.run_id), run_records(lease.client, base.info.run_id)
    if not records or not base_records:
        raise ForecastUnavailable("no records")
    clean = contamination(lease.client, run, records)
    if not clean.startswith("clean"):
        raise ForecastUnavailable(f"contamination check: {clean}")
    params = dict(run.data.params)
    params["model.path"] = local_model(params) or ""
    if config.spec.method == "eagle3":
        head = local_head(lease, params)
        if head is None:
            raise ForecastUnavailable(f"the EAGLE-3 head it served ({params.get('spec.draft_model')}) is not here")
        config = replace(config, spec=replace(config.spec, draft_model=head))
    steps = cached_steps(lease.name, base.info.run_id, config, params, base_records)
    return RunInputs(run, base, records, base_records, config, steps)


def variant_profile(lease: Lease, run, all_leases: list[Lease], steps_by_lease: dict, unit: str,
                    scope: str) -> StepCostProfile:
    """Step costs of the run's engine, model and site, fitted in `unit` on the other leases, or on the same lease's
    other runs (a probe on the same host; the run itself left out)."""
    group = lease_group(run)
    same = scope == "same lease"
    leave_out = {run.info.run_id}
    points = [s for lz in all_leases if (lz.name == lease.name) == same for s in steps_by_lease[lz.name]
              if s.run_id not in leave_out and any(r.info.run_id == s.run_id and lease_group(r) == group
                                                   for r in lz.runs)]
    if not any(p.excess_ms is not None for p in points):
        where = "this lease's other runs" if same else "another lease"
        raise ForecastUnavailable(f"no step costs of {'/'.join(group)} in {where}")
    config = run_config(run)
    return fit_profile(key_of(run), points, config.graph_batch_limit, unit=unit)


def forecast_rows(inputs: RunInputs, profile: StepCostProfile, row: dict) -> list[dict]:
    result = forecast(inputs.base_records, inputs.base.data.metrics, inputs.steps, inputs.config, profile)
    out = []
    for f in result.overall():
        c = f.concurrency
        m = records_speedup([r for r in inputs.records if r.get("concurrency") == c],
                            [r for r in inputs.base_records if r.get("concurrency") == c])
        out.append(row | {"c": c, "forecast": f.speedup, "forecast_low": f.low, "forecast_high": f.high,
                          "forecast_verdict": f.verdict, "measured": m.estimate, "measured_low": m.low,
                          "measured_high": m.high, "measured_verdict": verdict(m), "tokens_per_step": f.tokens_per_step,
                          "measured_tokens_per_step": inputs.run.data.metrics.get(f"accept_length_c{c}"),
                          "regime": f.regime, "error": f.speedup / m.estimate - 1.0,
                          "covered": f.low <= m.estimate <= f.high,
                          "profile_leases": ",".join(profile.leases), "flag": f.flag})
    return out


def save_all_profiles(all_leases: list[Lease], folder: Path = PROFILES) -> list[Path]:
    """One profile per engine / model / site over every lease's runs, every level of each (what a forecast on that
    site reads), saved in `folder`."""
    groups: dict[tuple, list] = {}
    for lz in all_leases:
        steps = level_steps(lz.client, lz.runs, lz.name)
        for run in lz.runs:
            groups.setdefault(lease_group(run), []).append((run, [s for s in steps if s.run_id == run.info.run_id]))
    paths = []
    for members in groups.values():
        steps = [s for _, ss in members for s in ss]
        if not any(s.excess_ms is not None for s in steps):
            continue
        newest = max((r for r, _ in members), key=lambda r: r.info.start_time)
        cap = next((run_config(r).graph_batch_limit for r, _ in members if run_config(r).graph_batch_limit), None)
        profile = fit_profile(key_of(newest), steps, cap, note=f"fitted on the journal's leases: "
                              f"{', '.join(sorted({s.lease for s in steps}))}")
        paths.append(save_profile(profile, folder))
    return paths


def summary(rows: list[dict], refused: int = 0) -> dict[str, float]:
    errs = np.array([abs(r["error"]) for r in rows])
    decided = [r for r in rows if r["measured_verdict"] != UNCLEAR]
    agree = [r for r in decided if r["forecast_verdict"] == r["measured_verdict"]]
    wrong = [r for r in rows if UNCLEAR not in (r["forecast_verdict"], r["measured_verdict"])
             and r["forecast_verdict"] != r["measured_verdict"]]
    share = (lambda n, d: n / d if d else float("nan"))
    return {"rows": len(rows), "mean_abs_error": float(errs.mean()) if len(errs) else float("nan"),
            "median_abs_error": float(np.median(errs)) if len(errs) else float("nan"),
            "covered": share(sum(r["covered"] for r in rows), len(rows)),
            "decided": len(decided), "agree": len(agree), "agree_share": share(len(agree), len(decided)),
            "opposite": len(wrong), "forecast_inconclusive": len(decided) - len(agree) - len(wrong),
            "refused_outside": refused}


GOALS = "goals: within host mean |error| <= 10 %, across hosts <= 15 %, no opposite verdict, >= 80 % inside the " \
    "interval, >= 80 % of decided levels decided alike"


def summary_table(rows: list[dict], skipped: list[dict]) -> list[str]:
    lines = ["| step costs in | fitted on | levels | mean / median |error| | measured inside the interval | "
             "decided alike | opposite | refused: host outside the profile |", "|---|---|---|---|---|---|---|---|"]
    for unit, scope in VARIANTS:
        mine = [r for r in rows if (r["unit"], r["scope"]) == (unit, scope)]
        refused = sum(1 for r in skipped if r.get("outside") and (r.get("unit"), r.get("scope")) == (unit, scope))
        s = summary(mine, refused)
        lines.append(f"| {'baseline steps' if unit == 'base' else 'ms'} | {scope} | {s['rows']} | "
                     f"{100 * s['mean_abs_error']:.1f} / {100 * s['median_abs_error']:.1f} % | "
                     f"{100 * s['covered']:.0f} % | {s['agree']} of {s['decided']} ({100 * s['agree_share']:.0f} %) | "
                     f"{s['opposite']} | {refused} |")
    return lines + ["", GOALS]


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    return f"{r['forecast']:.2f} [{r['forecast_low']:.2f}, {r['forecast_high']:.2f}] {100 * r['error']:+.0f} %"


def markdown(rows: list[dict], skipped: list[dict]) -> list[str]:
    """The summary per variant, then one row per run and level: the host-relative forecast from other leases and
    from the same lease beside the measurement."""
    lines = [*summary_table(rows, skipped), "",
             "| lease | run | option | workload | k | c | tokens/step forecast / measured | measured | "
             "forecast from other leases | forecast within the lease | verdicts (other leases / within / measured) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    keyed = {(r["lease"], r["run"], r["c"], r["unit"], r["scope"]): r for r in rows}
    seen = []
    for r in rows:
        if (r["lease"], r["run"], r["c"]) not in seen:
            seen.append((r["lease"], r["run"], r["c"]))
    for lease, run, c in seen:
        across, within = (keyed.get((lease, run, c, "base", scope)) for scope in ("other leases", "same lease"))
        r = across or within
        mt = r["measured_tokens_per_step"]
        lines.append(f"| {lease} | {run} | {r['option']} {r['method']} | {r['workload']} | {r['k']} | {c} | "
                     f"{r['tokens_per_step']:.2f} / {'-' if mt is None else f'{mt:.2f}'} | "
                     f"{r['measured']:.2f} [{r['measured_low']:.2f}, {r['measured_high']:.2f}] | {_cell(across)} | "
                     f"{_cell(within)} | {across['forecast_verdict'] if across else '-'} / "
                     f"{within['forecast_verdict'] if within else '-'} / {r['measured_verdict']} |")
    lines += ["", "Not forecast (host-relative step costs):"] + [
        f"- {r['lease']} {r['run']} {r['option']} {r['workload']} k={r['k']}"
        f"{' (' + r['scope'] + ')' if 'scope' in r else ''}: {r['reason']}"
        for r in skipped if r.get("unit", "base") == "base"]
    return lines


BEGIN, END = "<!-- generated by experiments.analysis.speedup.validate -->", "<!-- end of generated part -->"


def write_generated(path: Path, table: list[str]) -> None:
    """Replace what lies between the markers (or append them) and keep the hand-written text around them."""
    text = path.read_text() if path.exists() else ""
    block = "\n".join([BEGIN, *table, END])
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text + ("\n" if text else "") + block + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.analysis.speedup.validate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--journal", type=Path, default=ROOT / "docs" / "journal")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    ap.add_argument("--write", type=Path, default=None,
                    help="replace the generated part of this markdown file (docs/reference/forecast-validation.md)")
    ap.add_argument("--save-profiles", action="store_true",
                    help="also fit each engine/model/site over every lease and store it as its step-cost profile")
    a = ap.parse_args(argv)
    found = leases(a.journal)
    if a.save_profiles:
        for path in save_all_profiles(found):
            print(f"step-cost profile: {path}")
    rows, skipped = validation_rows(found)
    table = markdown(rows, skipped)
    print("\n".join(table))
    if a.write:
        write_generated(a.write, table)
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "skipped": skipped}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
