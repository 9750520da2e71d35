"""The runner overrides that measure a recommendation's choice again, for one load:

    python -m experiments.analysis.recommend.remeasure <recommendation-*.json | its folder> --arrival poisson --rate 32
        [--concurrency C] [--workload NAME] [--tracking-uri URI]

prints `+option=X spec.<key>=<value> ...` on one line, read from the params of the runs the choice was decided on
(so it reproduces what was measured, not what the option's defaults are today). Where the load's choice is no
speculation it prints the best candidate's (the highest lower end of the interval), and says so on stderr: measured
again, it checks that nothing pays there. Exit 2 when the recommendation has no such load or no candidate.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from experiments.analysis.recommend.decision import NO_SPECULATION
from experiments.tracking.offline_store import client_for


def recommendation_file(path: Path) -> Path:
    """`path`, or the one recommendation-*.json in the folder `path`."""
    if path.is_file():
        return path
    found = sorted(path.glob("recommendation-*.json"))
    if len(found) != 1:
        raise FileNotFoundError(f"{path}: expected one recommendation-*.json, found {len(found)}")
    return found[0]


def load_decision(doc: dict, arrival: str, rate: float | None, concurrency: int | None,
                  workload: str | None = None) -> dict:
    """The decision for that load in the workload named (by its config name or prompt set); without a name, the
    one workload that has the load."""
    found = [(w["workload"], d) for w in doc["workloads"] if workload in (None, w["workload"], w["prompt_set"])
             for d in w["loads"] if d["arrival"] == arrival and (rate is None or d["rate"] == rate)
             and (concurrency is None or d["concurrency"] == concurrency)]
    if not found:
        raise LookupError(f"no load {arrival} rate={rate} concurrency={concurrency}"
                          f"{'' if workload is None else f' of workload {workload}'} in the recommendation")
    if len(found) > 1:
        matches = ", ".join(f"{w}: {d['load']}" for w, d in found)
        raise LookupError(f"{len(found)} loads match ({matches}): name one with --workload, --rate or --concurrency")
    return found[0][1]


def chosen_candidate(decision: dict) -> tuple[dict, bool]:
    """(the candidate to measure again, whether it is the recommendation's own choice)."""
    by_label = {c["label"]: c for c in decision["candidates"]}
    if decision["choice"] != NO_SPECULATION and decision["choice"] in by_label:
        return by_label[decision["choice"]], True
    if not decision["candidates"]:
        raise LookupError(f"{decision['load']}: no candidate was measured")
    return max(decision["candidates"], key=lambda c: c["speedup"]["low"]), False


def overrides_of(run: Any) -> list[str]:
    """`+option=<option>` and every spec setting the run was measured with."""
    params, option = run.data.params, run.data.tags["specws.option"]
    spec = sorted((k, v) for k, v in params.items() if k.startswith("spec.") and v not in ("None", "null", ""))
    return [f"+option={option}", *(f"{k}={v}" for k, v in spec)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.analysis.recommend.remeasure",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("recommendation", type=Path, help="recommendation-*.json, or the folder recommend wrote it to")
    ap.add_argument("--arrival", default="closed", help="closed | poisson | gamma")
    ap.add_argument("--rate", type=float, default=None, help="requests/s of the open-loop load")
    ap.add_argument("--concurrency", type=int, default=None, help="the level (closed) or the cap (open loop)")
    ap.add_argument("--workload", default=None, help="the workload's config name or prompt set")
    ap.add_argument("--tracking-uri", default=None, help="the store of the runs (default: the one in the json)")
    args = ap.parse_args(argv)
    try:
        doc = json.loads(recommendation_file(args.recommendation).read_text())
        decision = load_decision(doc, args.arrival, args.rate, args.concurrency, args.workload)
        candidate, own = chosen_candidate(decision)
    except (OSError, LookupError, KeyError, ValueError) as exc:
        print(f"recommended: {exc}", file=sys.stderr)
        return 2
    uri = args.tracking_uri or doc.get("tracking_uri")
    if not uri:
        print("recommended: --tracking-uri is needed (the recommendation names no store)", file=sys.stderr)
        return 2
    if not own:
        print(f"{decision['load']}: the recommendation is {decision['choice']} ({decision['status']}); measuring "
              f"the best candidate, {candidate['label']}, again to check that it does not pay", file=sys.stderr)
    print(" ".join(overrides_of(client_for(uri).get_run(candidate["runs"][0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
