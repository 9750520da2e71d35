"""Run an engine's own argparse parser and its follow-up checks, turning every refusal into the engine's
message. Imported by vllm_check.py / sglang_check.py, which run inside the engines' interpreters, so it
depends on the standard library only."""
import argparse
import contextlib
import io
from collections.abc import Callable


def parse_and_check(parser: argparse.ArgumentParser, argv: list[str],
                    then: Callable[[argparse.Namespace], dict | None], version: str) -> dict:
    """{"ok", "version", "error"[, "limits"]}: `error` is argparse's last line or the check's exception;
    `limits` what the check returned (the engine's resolved limits), when it returned any."""
    result = {"ok": False, "version": version, "error": None}
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(argv)
    except SystemExit:
        result["error"] = err.getvalue().strip().splitlines()[-1]
        return result
    try:
        limits = then(ns)
    except Exception as exc:  # the engine's own message is the point
        result["error"] = f"{type(exc).__name__}: {exc}"
        return result
    result["ok"] = True
    if limits:
        result["limits"] = limits
    return result
