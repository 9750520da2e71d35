"""A stand-in entry point for the launcher that starts one worker the way SGLang starts its scheduler
processes (multiprocessing, spawn) and makes there the call `Scheduler.__init__` makes
(`SpeculativeAlgorithm.from_string`), through SGLang's scheduler module when it imports (on a GPU host)
and through `sglang.srt.speculative.spec_info` otherwise (it imports on the CPU). The worker reports, on
stdout, whether what it ran was patched.

    SPECWS_SGLANG_ENTRY=sglang_patches.probe SPECWS_SGLANG_PATCHES=reach_marker python -m sglang_patches.launch
"""
from __future__ import annotations

import inspect
import json
import multiprocessing as mp
import os
import sys


def run_worker(queue) -> None:
    try:
        from sglang.srt.managers import scheduler as worker_module
    except Exception:  # CPU machine: the scheduler module needs CUDA-side packages
        from sglang.srt.speculative import spec_info as worker_module
    algo_cls = worker_module.SpeculativeAlgorithm
    algo = algo_cls.from_string("NGRAM")
    stored = inspect.getattr_static(algo_cls, "from_string")
    queue.put({"pid": os.getpid(), "process": mp.current_process().name, "module": worker_module.__name__,
               "patch": getattr(getattr(stored, "__func__", stored), "__specws_patch__", None),
               "result": str(algo)})


def main() -> int:
    # Run as __main__ by the launcher: take the worker function from the importable module, as SGLang's
    # targets (run_scheduler_process, ...) live in importable modules.
    from sglang_patches.probe import run_worker as target

    ctx = mp.get_context("spawn")   # as sglang.srt.entrypoints.engine: mp.set_start_method("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(queue,), name="probe_worker")
    proc.start()
    result = queue.get(timeout=300)
    proc.join(60)
    print("PROBE_RESULT " + json.dumps(result), flush=True)
    return 0 if proc.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
