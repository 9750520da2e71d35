"""Tracking: the MLflow store (or the offline store on a host without MLflow), the one run lifecycle
(`tracked_run`), per-request records (write, read, download), the importer and the plots.

May import config; never harness, engines or analysis.
"""
