"""Validate vLLM server command lines with vLLM's own parser; runs inside vLLM's environment.

Usage: <vllm python> vllm_check.py [--engine-config] -- <server args>  -> one JSON line
       <vllm python> vllm_check.py --batch          -> [[engine_config, argv], ...] on stdin, a JSON list out
       <vllm python> vllm_check.py --serve SOCKET   -> answers batches on a Unix socket (see `serve`)
Each answer: {"ok": bool, "version": str, "error": str | null[, "limits": {...}]} (limits with the engine config).
Imports only vLLM, the standard library and parse_check (its sibling).
"""
import contextlib
import json
import os
import socket
import sys
import traceback

from parse_check import parse_and_check

ACCEPT_POLL_S = 2.0   # how often a serving checker looks whether the process that started it is still there


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


def check_many(checks: list[list]) -> list[dict]:
    """[[engine_config, argv], ...] -> one answer each, in order."""
    with contextlib.redirect_stdout(sys.stderr):
        return [check(list(argv), bool(deep)) for deep, argv in checks]


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


def serve(path: str) -> None:
    """Answer batches on the Unix socket `path` until the process that started this one is gone: one JSON line
    {"python": interpreter, "env": the caller's environment, "checks": [[engine_config, argv], ...]} per
    connection, one JSON list back (null when `python` is not this interpreter). vLLM is imported once; every
    batch is checked in a forked child given the caller's environment, so that each starts from the state a
    fresh process of the caller has and none sees what an earlier check left behind."""
    parent = os.getppid()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(16)   # bound before the import: a client may connect now and is answered once it is done
        with contextlib.redirect_stdout(sys.stderr):
            check(["--model", "x"], False)
        server.settimeout(ACCEPT_POLL_S)
        while os.getppid() == parent:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                _answer_in_child(conn)


def _answer_in_child(conn: socket.socket) -> None:
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)
        return
    try:
        request = json.loads(conn.makefile("r").readline())
        mine = os.path.abspath(request["python"]) == os.path.abspath(sys.executable)
        os.environ.clear()
        os.environ.update(request["env"])
        conn.sendall((json.dumps(check_many(request["checks"]) if mine else None) + "\n").encode())
        print(f"checked {len(request['checks']) if mine else 0} command lines for {request['python']}", file=sys.stderr)
    except Exception:   # the client then checks in a process of its own, which reports the error
        traceback.print_exc()
    finally:
        os._exit(0)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--serve"]:
        serve(args[1])
        sys.exit(0)
    if args == ["--batch"]:
        out = check_many(json.load(sys.stdin))
    else:
        deep = "--engine-config" in args[: args.index("--")] if "--" in args else False
        out = check_many([[deep, args[args.index("--") + 1:] if "--" in args else args]])[0]
    print(json.dumps(out))
