"""Analysis: reads records and runs; the harness never imports analysis."""
