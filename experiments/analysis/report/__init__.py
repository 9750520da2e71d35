"""The decision report: `cli` (speedup series, verdicts and the page for an experiment or a sweep; the command
`python -m experiments.analysis.report`), `inputs` (the runs a report or a recommendation is made of), `figure`,
`page` (the HTML), `host` and `telemetry` (the report's sections)."""
from experiments.analysis.report.cli import (
    CONTAMINATED,
    OptionSeries,
    Point,
    ReportInputError,
    build_series,
    main,
    records_of,
    select_runs,
    t_interval,
    verdict_of,
)

__all__ = ["CONTAMINATED", "OptionSeries", "Point", "ReportInputError", "build_series", "main", "records_of",
           "select_runs", "t_interval", "verdict_of"]
