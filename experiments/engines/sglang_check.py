"""Validate an SGLang server command line with SGLang's own parser (ServerArgs.add_cli_args, then
from_cli_args, then SGLang's speculative-algorithm enum). Runs in the interpreter that serves.

Usage: <python> sglang_check.py <server args>. Prints one JSON line {"ok", "version", "error"}.
Imports only SGLang and parse_check (its sibling).
"""
import argparse
import contextlib
import json
import sys

try:
    from experiments.engines.parse_check import parse_and_check
except ImportError:  # run as a script in SGLang's interpreter, next to parse_check.py
    from parse_check import parse_and_check


def check(argv: list[str]) -> dict:
    try:
        import sglang
        from sglang.srt.server_args import ServerArgs
    except Exception as exc:
        return {"ok": False, "version": "unknown",
                "error": f"cannot import SGLang's parser: {type(exc).__name__}: {exc}"}

    def then(ns: argparse.Namespace) -> None:
        args = ServerArgs.from_cli_args(ns)
        # resolve_once() would finish the checks but reaches for the model hub; the algorithm name is
        # checked by SGLang's own enum, as the server does at start.
        if args.speculative_algorithm:
            from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
            SpeculativeAlgorithm.from_string(args.speculative_algorithm)

    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    return parse_and_check(parser, argv, then, sglang.__version__)


if __name__ == "__main__":
    with contextlib.redirect_stdout(sys.stderr):
        out = check(sys.argv[1:])
    print(json.dumps(out))
