"""The run pipeline."""
