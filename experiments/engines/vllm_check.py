"""Validate a vLLM server command line with vLLM's own parser; runs inside vLLM's environment.

Usage: <vllm python> vllm_check.py [--engine-config] -- <server args>. Prints one JSON line:
{"ok": bool, "version": str, "error": str | null[, "limits": {...}]} (limits with --engine-config).
Imports only vLLM and parse_check (its sibling).
"""
import contextlib
import json
import sys

from parse_check import parse_and_check


def check(argv: list[str], engine_config: bool) -> dict:
    import vllm
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def then(args) -> dict | None:
        validate_parsed_serve_args(args)
        if not engine_config:
            return None
        # deeper: speculative config, model config (reads the local model folder), after every post-init
        from vllm.engine.arg_utils import AsyncEngineArgs
        return engine_limits(AsyncEngineArgs.from_cli_args(args).create_engine_config())

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm.entrypoints.openai.api_server"))
    return parse_and_check(parser, argv, then, vllm.__version__)


def engine_limits(config) -> dict:
    """The scheduler limits and speculative settings vLLM resolved (VllmConfig after __post_init__)."""
    sched, model, spec = config.scheduler_config, config.model_config, config.speculative_config
    out = {k: getattr(sched, k, None) for k in ("max_num_seqs", "max_num_batched_tokens", "max_num_scheduled_tokens",
                                                "enable_chunked_prefill", "async_scheduling")}
    out["max_model_len"] = model.max_model_len
    if spec is not None:
        out |= {f"speculative_{k}": getattr(spec, k, None)
                for k in ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")}
    return {k: v if isinstance(v, (bool, str)) or v is None else float(v) for k, v in out.items() if v is not None}


if __name__ == "__main__":
    args = sys.argv[1:]
    deep = "--engine-config" in args[: args.index("--")] if "--" in args else False
    server_args = args[args.index("--") + 1:] if "--" in args else args
    with contextlib.redirect_stdout(sys.stderr):
        out = check(server_args, deep)
    print(json.dumps(out))
