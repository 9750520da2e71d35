"""Validate a vLLM server command line with vLLM's own parser; runs inside vLLM's environment.

Usage: <vllm python> vllm_check.py [--engine-config] -- <server args>. Prints one JSON line:
{"ok": bool, "version": str, "error": str | null}. Imports only vLLM and parse_check (its sibling).
"""
import contextlib
import json
import sys

from parse_check import parse_and_check


def check(argv: list[str], engine_config: bool) -> dict:
    import vllm
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def then(args) -> None:
        validate_parsed_serve_args(args)
        if engine_config:  # deeper: speculative config, model config (reads the local model folder)
            from vllm.engine.arg_utils import AsyncEngineArgs
            AsyncEngineArgs.from_cli_args(args).create_engine_config()

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm.entrypoints.openai.api_server"))
    return parse_and_check(parser, argv, then, vllm.__version__)


if __name__ == "__main__":
    args = sys.argv[1:]
    deep = "--engine-config" in args[: args.index("--")] if "--" in args else False
    server_args = args[args.index("--") + 1:] if "--" in args else args
    with contextlib.redirect_stdout(sys.stderr):
        out = check(server_args, deep)
    print(json.dumps(out))
