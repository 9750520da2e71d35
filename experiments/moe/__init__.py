"""Option E's machinery: a small DeepSeek-V3-style MoE built from SmolLM2 (build, model), routing under an
expert budget (routing), the prompts it is measured on (workload, prompts.json), expert telemetry of offline runs
(telemetry, expert_growth.json) and of served ones: the H200 MoE script (h200_serve: SGLang serving the small MoE,
or the Kimi miniature of experiments/box, with expert telemetry and the budget grid) and its results as step and
expert tables and the served expert curve (served_curve). options/budget.py runs E offline on model, routing and
workload.

h200_serve and served_curve stay here although the Kimi leases run them too: the script measures option E on
prompts.json, and telemetry compares the offline routing of the same prompts with what was served, through
served_curve. The Kimi miniature itself and the box's other tools are in experiments/box.

May import config, engines, eagle3, harness, tracking and sglang_patches; options and box import moe.
"""
