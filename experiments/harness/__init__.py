"""The run pipeline: preflight (refusals before anything starts), launch (argv, env, port), server (process
group, health, pool), workloads (formats, loaders, sampling, rendering), client (per-request records), summary,
baseline (find / pair / compare), sweep.

May import config, engines and tracking; never analysis.
"""
