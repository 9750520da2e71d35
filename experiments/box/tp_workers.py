"""Did the patches reach every tensor-parallel worker? Read from an SGLang server log started through
`python -m sglang_patches.launch`, which writes one SPECWS_SGLANG_PATCHES_REPORT line per process.

`python -m experiments.box.tp_workers SERVER.log --tp 8 [--json OUT]`   (exit 1 when a worker lacks them)

SGLang 0.5.14 spawns one scheduler process per TP rank plus the detokenizer; each applies the launcher's patches
before SGLang's code runs there. Its processes carry no rank in their identity (multiprocessing names them
Process-N), so the check is by count: at least `tp` spawned processes must report every patch the launcher
applied, and none may report a refusal.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sglang_patches.applying import parse_log


def _applied_names(report: dict) -> set[str]:
    return {r["name"] for r in report.get("applied", [])}


def check_patched_workers(log_text: str, tp: int) -> dict:
    """{ok, why, launcher_applied, patched_processes, refused}: the patches reached >= tp spawned processes."""
    parsed = parse_log(log_text)
    launcher = parsed["launcher"]
    result = {"ok": False, "tp": tp, "launcher_applied": [], "patched_processes": 0, "refused": []}
    if launcher is None:
        return {**result, "why": "no launcher report: the server was not started through sglang_patches.launch"}
    if launcher.get("refused"):
        return {**result, "why": f"the launcher refused: {launcher['refused']}"}
    wanted = _applied_names(launcher)
    result["launcher_applied"] = sorted(wanted)
    if not wanted:
        return {**result, "why": "the launcher applied no patch: nothing for the workers to show"}
    spawned = [r for r in parsed["processes"] if r.get("role") == "spawned"]
    result["refused"] = [r for r in spawned if r.get("refused")]
    result["patched_processes"] = sum(1 for r in spawned if wanted <= _applied_names(r))
    if result["refused"]:
        return {**result, "why": f"{len(result['refused'])} spawned process(es) refused a patch"}
    if result["patched_processes"] < tp:
        return {**result, "why": f"only {result['patched_processes']} spawned processes applied "
                                 f"{sorted(wanted)}, fewer than the {tp} TP workers"}
    return {**result, "ok": True, "why": f"{result['patched_processes']} spawned processes applied {sorted(wanted)}"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.box.tp_workers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", type=Path)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    result = check_patched_workers(a.log.read_text(errors="replace"), a.tp)
    print(("OK: " if result["ok"] else "FAILED: ") + result["why"])
    if a.json:
        a.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
