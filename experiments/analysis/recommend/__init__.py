"""One answer per load, the configuration to deploy: `cli` (the recommendation built from an experiment's runs,
written and logged; the command `python -m experiments.analysis.recommend`), `decision` (the decision per load and
the ranges), `flags` (engine flags and schedules across loads), `render` (Markdown and the report's HTML section),
`remeasure` (a choice back as runner overrides: `python -m experiments.analysis.recommend.remeasure`)."""
from experiments.analysis.recommend.cli import Recommendation, build, log_recommendation, main, write

__all__ = ["Recommendation", "build", "log_recommendation", "main", "write"]
