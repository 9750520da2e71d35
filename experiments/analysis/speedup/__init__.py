"""The speedup model: a step-cost model (`model`), its fit from stored runs (`fit`), its CLI."""
