"""Analysis: reads records and runs after they are made -- paired statistics and verdicts, per-category
results, n-gram replay, the speedup model and its post-run prediction, the decision report.

May import config, engines and tracking; the harness never imports analysis.
"""
