"""Speculative-decoding experiment workspace: config -> launch spec -> server -> workload -> MLflow."""
