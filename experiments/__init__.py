"""Speculative-decoding experiment workspace.

One run flows one way: config (Hydra composition, typed views) -> harness (preflight, launch, server, workload
client, records, summary, baseline pairing) -> engines (the only place SGLang and vLLM differ) -> tracking
(the MLflow run lifecycle, records, plots). analysis reads records and runs afterwards; the harness never
imports it. options/ holds the runners of options that are more than one measurement; eagle3/ and moe/ the
option D and E machinery; hosts/ the logistics of machines other than this one. `run.py` is the entry point.
"""
