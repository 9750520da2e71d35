"""Validate a vLLM server command line with vLLM's own parser; runs inside vLLM's environment.

Usage: <vllm python> vllm_check.py [--engine-config] -- <server args>. Prints one JSON line:
{"ok": bool, "version": str, "error": str | null}. Standalone on purpose: it imports only vLLM.
"""
import contextlib
import io
import json
import sys


def check(argv: list[str], engine_config: bool) -> dict:
    import vllm
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    result = {"ok": False, "version": vllm.__version__, "error": None}
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm.entrypoints.openai.api_server"))
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parser.parse_args(argv)
    except SystemExit:
        result["error"] = stderr.getvalue().strip().splitlines()[-1]
        return result
    try:
        validate_parsed_serve_args(args)
        if engine_config:  # deeper: speculative config, model config (reads the local model folder)
            from vllm.engine.arg_utils import AsyncEngineArgs
            AsyncEngineArgs.from_cli_args(args).create_engine_config()
    except Exception as exc:  # the engine's own message is the point
        result["error"] = f"{type(exc).__name__}: {exc}"
        return result
    result["ok"] = True
    return result


if __name__ == "__main__":
    args = sys.argv[1:]
    deep = "--engine-config" in args[: args.index("--")] if "--" in args else False
    server_args = args[args.index("--") + 1:] if "--" in args else args
    with contextlib.redirect_stdout(sys.stderr):
        out = check(server_args, deep)
    print(json.dumps(out))
