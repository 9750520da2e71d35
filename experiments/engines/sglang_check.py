"""Validate SGLang server command lines with SGLang's own parser (ServerArgs.add_cli_args, then
from_cli_args, then SGLang's speculative-algorithm enum). Runs in the interpreter that serves.

Usage: <python> sglang_check.py <server args>   -> one JSON line {"ok", "version", "error"}
       <python> sglang_check.py --batch          -> a JSON list of argv lists on stdin, one JSON list out
       <python> sglang_check.py --list-flags     -> {"version", "flags": [every option string]}
       <python> sglang_check.py --values K...    -> argv lists on stdin; per argv {K: value as SGLang parsed it}
Imports only SGLang and parse_check (its sibling).
"""
import argparse
import contextlib
import importlib.util
import json
import os
import sys

try:
    from experiments.engines.parse_check import parse_and_check
except ImportError:  # run as a script in SGLang's interpreter, next to parse_check.py
    from parse_check import parse_and_check


def _declare_torchvision_ops_if_unloadable() -> None:
    """SGLang 0.5.14 imports torchvision at module level. PyPI's torchvision is built against CUDA torch; on a
    CPU torch its C ops do not load and torchvision 0.28 then fails at import, registering fake kernels for
    torchvision::nms/qnms without checking the ops exist. Declaring those two schemas lets its Python part
    import (the parser never calls them). Where the ops load (a CUDA torch), nothing is done."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or "torchvision" in sys.modules:
        return
    import torch

    if hasattr(torch.ops.torchvision, "nms"):  # loaded or declared before
        return
    try:
        torch.ops.load_library(os.path.join(os.path.dirname(spec.origin), "_C.so"))
    except (OSError, RuntimeError):
        lib = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _declare_torchvision_ops_if_unloadable.keep = lib  # the declarations live as long as the library object


def _server_args_parser() -> tuple[argparse.ArgumentParser, str]:
    _declare_torchvision_ops_if_unloadable()
    import sglang
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    return parser, sglang.__version__


def check_many(argvs: list[list[str]]) -> list[dict]:
    try:
        parser, version = _server_args_parser()
        from sglang.srt.server_args import ServerArgs
    except Exception as exc:
        error = f"cannot import SGLang's parser: {type(exc).__name__}: {exc}"
        return [{"ok": False, "version": "unknown", "error": error} for _ in argvs]

    # From 0.5.23 on, construction only records the arguments and resolve_once() resolves them (it reaches
    # for the model hub, so it is not run here). Before, __post_init__ resolved against the device and the
    # model at construction, which needs the GPU host: there only the parser and the enum below run.
    constructs_unresolved = hasattr(ServerArgs, "resolve_once")

    def then(ns: argparse.Namespace) -> None:
        if constructs_unresolved:
            ServerArgs.from_cli_args(ns)
        # The algorithm name is checked by SGLang's own enum, as the server does at start.
        if ns.speculative_algorithm:
            from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
            SpeculativeAlgorithm.from_string(ns.speculative_algorithm)

    return [parse_and_check(parser, argv, then, version) for argv in argvs]


def check(argv: list[str]) -> dict:
    return check_many([argv])[0]


def parsed_values(argvs: list[list[str]], keys: list[str]) -> list[dict]:
    """What SGLang's parser makes of each argv, for `keys`: the ServerArgs field where construction does not
    resolve (0.5.23 on), else the parsed namespace (older releases resolve against the GPU at construction)."""
    parser, _ = _server_args_parser()
    from sglang.srt.server_args import ServerArgs

    out = []
    for argv in argvs:
        ns = parser.parse_args(argv)
        source = ServerArgs.from_cli_args(ns) if hasattr(ServerArgs, "resolve_once") else ns
        out.append({k: getattr(source, k, None) for k in keys})
    return out


def list_flags() -> dict:
    parser, version = _server_args_parser()
    return {"version": version, "flags": sorted(s for a in parser._actions for s in a.option_strings)}


if __name__ == "__main__":
    with contextlib.redirect_stdout(sys.stderr):
        if sys.argv[1:] == ["--batch"]:
            out = check_many(json.load(sys.stdin))
        elif sys.argv[1:] == ["--list-flags"]:
            out = list_flags()
        elif sys.argv[1:2] == ["--values"]:
            out = parsed_values(json.load(sys.stdin), sys.argv[2:])
        else:
            out = check(sys.argv[1:])
    print(json.dumps(out))
