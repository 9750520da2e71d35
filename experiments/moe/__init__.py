"""Option E's machinery: a small DeepSeek-V3-style MoE built from SmolLM2 (build, model), routing under an
expert budget (routing), expert telemetry of served and offline runs (telemetry), the H200 MoE script."""
