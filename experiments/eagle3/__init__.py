"""EAGLE-3 draft heads for the embedded target, trained on the CPU.

data (the target's own greedy answers) → features (aux hidden states, final hidden) → train (training-time
test) → export (the `LlamaForCausalLMEagle3` checkpoint layout vLLM's "eagle3" and SGLang load).
`train_head` in `experiments.eagle3.train` runs all four; `python -m experiments.eagle3` is its CLI.
"""
