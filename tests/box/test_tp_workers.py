"""The TP-worker patch check on synthetic server logs written with the launcher's own report format."""
from __future__ import annotations

import json

from experiments.box.tp_workers import check_patched_workers, main
from sglang_patches.applying import REPORT_PREFIX


def report(role: str, pid: int, applied: list[str], refused: str | None = None) -> str:
    record = {"role": role, "pid": pid, "process": f"Process-{pid}", "sglang_version": "0.5.14",
              "applied": [{"name": n, "target": "x", "check": True, "link": None} for n in applied]}
    if refused:
        record["refused"] = refused
    return f"[2026-12-02 06:00:00] {REPORT_PREFIX}{json.dumps(record)}"


def server_log(workers: int, applied: tuple[str, ...] = ("moe_budget",), extra: tuple[str, ...] = ()) -> str:
    lines = [report("launcher", 1, ["moe_budget"]), "[2026-12-02] Load weight begin"]
    lines += [report("spawned", 10 + i, list(applied)) for i in range(workers)]
    return "\n".join([*lines, *extra, "The server is fired up and ready to roll!"])


def test_eight_workers_and_the_detokenizer_pass() -> None:
    result = check_patched_workers(server_log(9), tp=8)
    assert result["ok"] and result["patched_processes"] == 9 and result["launcher_applied"] == ["moe_budget"]


def test_a_missing_worker_fails() -> None:
    result = check_patched_workers(server_log(7), tp=8)
    assert not result["ok"] and "only 7" in result["why"]


def test_a_worker_with_other_patches_is_not_counted() -> None:
    assert not check_patched_workers(server_log(8, applied=("other",)), tp=8)["ok"]


def test_a_refusal_or_no_launcher_fails() -> None:
    refused = server_log(9, extra=(report("spawned", 99, [], refused="version 0.5.9 not supported"),))
    assert "refused" in check_patched_workers(refused, tp=8)["why"]
    assert "no launcher report" in check_patched_workers("plain SGLang log\n", tp=8)["why"]


def test_cli_exit_status(tmp_path, capsys) -> None:
    log = tmp_path / "server.log"
    log.write_text(server_log(8))
    assert main([str(log), "--tp", "8", "--json", str(tmp_path / "r.json")]) == 0
    assert main([str(log), "--tp", "9"]) == 1
    assert "FAILED" in capsys.readouterr().out
