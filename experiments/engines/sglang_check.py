"""Validate an SGLang server command line with SGLang's own parser (ServerArgs.add_cli_args, then
from_cli_args, then SGLang's speculative-algorithm enum). Runs in the interpreter that serves.

Usage: <python> sglang_check.py <server args>. Prints one JSON line {"ok", "version", "error"}.
Standalone on purpose: it imports only SGLang.
"""
import argparse
import contextlib
import io
import json
import sys


def check(argv: list[str]) -> dict:
    result = {"ok": False, "version": "unknown", "error": None}
    try:
        import sglang
        from sglang.srt.server_args import ServerArgs
    except Exception as exc:
        result["error"] = f"cannot import SGLang's parser: {type(exc).__name__}: {exc}"
        return result
    result["version"] = sglang.__version__
    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(argv)
    except SystemExit:
        result["error"] = err.getvalue().strip().splitlines()[-1]
        return result
    try:
        args = ServerArgs.from_cli_args(ns)
        # resolve_once() would finish the checks but reaches for the model hub; the algorithm name is
        # checked by SGLang's own enum, as the server does at start.
        if args.speculative_algorithm:
            from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
            SpeculativeAlgorithm.from_string(args.speculative_algorithm)
    except Exception as exc:  # the engine's own message is the point
        result["error"] = f"{type(exc).__name__}: {exc}"
        return result
    result["ok"] = True
    return result


if __name__ == "__main__":
    with contextlib.redirect_stdout(sys.stderr):
        out = check(sys.argv[1:])
    print(json.dumps(out))
