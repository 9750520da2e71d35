"""The Blackwell box (Kimi-K2.5 INT4, SGLang TP 8) and its miniatures on the lent H200 hosts: the tools its leases
run, each a script (`python -m experiments.box.<name>`, on the host with its python3 and the offline bundle unless
it says otherwise), and the readers of what they write there.

- Kimi-K2.5 in miniature: `kimi_mini` (the model folder SGLang's dummy loader serves, at any depth),
  `kimi_kernels` (the INT4 MoE kernels at Kimi's shapes: SGLang's Marlin against the Triton W4A16 kernel).
- Where a decode step's time goes: `decode_trace` (SGLang's profiler traces of the miniature's decode steps,
  through the H200 MoE script's servers) and `decode_profile` (their kernel-time shares, next to the box's seed
  profile; runs here too).
- The box's tensor parallelism on a multi-GPU host: `allreduce_bench` (all-reduce bus bandwidth at Kimi's per-step
  sizes, nccl-tests style) and `tp_workers` (whether the patches reached every TP worker, from a server's log).

Not here, though they serve the box too:
- the box's memory per GPU (`analysis/box_memory.py`): the box's band model (`analysis/speedup/box_terms.py`)
  computes the drafter's bytes with it, and `decode_profile` here reads the speedup model's `BoxProfile`; moved
  here, analysis and box would import each other.
- the H200 MoE script and the reader of its results (`moe/h200_serve.py`, `moe/served_curve.py`): option E served
  (expert telemetry and the budget grid, on the small MoE or this miniature), on the prompts `moe/workload.py`
  writes for the offline telemetry too, which compares with the served counts through `served_curve`.

May import config, harness, analysis, moe and sglang_patches; nothing of the workspace imports box.
"""
