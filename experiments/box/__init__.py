"""The Blackwell box (Kimi-K2.5 INT4, SGLang TP 8) and its miniatures on the lent H200 hosts: the tools its leases
run, each a script (`python -m experiments.box.<name>`, on the host with its python3 and the offline bundle unless
it says otherwise).

- Kimi-K2.5 in miniature: `kimi_mini` (the model folder SGLang's dummy loader serves, at any depth),
  `kimi_kernels` (the INT4 MoE kernels at Kimi's shapes: SGLang's Marlin against the Triton W4A16 kernel).

May import config and sglang_patches; nothing of the workspace imports box.
"""
