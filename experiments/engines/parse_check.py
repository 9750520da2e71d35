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
        lines = err.getvalue().strip().splitlines()
        result["error"] = lines[-1] if lines else _silent_exit(parser, argv)
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


def _silent_exit(parser: argparse.ArgumentParser, argv: list[str]) -> str:
    """Why the parser stopped without writing an error: a flag that prints and exits (--help, --version), which
    is no server setting."""
    exiting = {option for action in parser._actions   # help and version: no value, no default
               if action.nargs == 0 and action.default == argparse.SUPPRESS for option in action.option_strings}
    named = [arg for arg in argv if arg.split("=", 1)[0] in exiting]   # vLLM reads --help=<group>
    if named:
        return f"{' '.join(named)} exits the parser without an error message (it is not a server flag)"
    return "the command line exits the parser without an error message"
