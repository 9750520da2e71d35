"""The lease plans in Python: a step runner with a time budget, gates, timeouts and a dry run (`steps`), the knobs
of each plan as typed `key=value` settings (`settings`), the host's folders and the step kinds the plans share
(`host`), and one module per plan: `kimi`, `tp8`, `load`, `d`, `probe`, and `h200`'s measure, standard and pairs.
Run one with `python -m experiments.plans NAME [--dry-run] [key=value ...] [-- OVERRIDES ...]`; `bin/*` are
recipes that do. Only the standard library is imported here: the H200 host runs it on its own python3."""
