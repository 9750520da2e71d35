"""`python -m experiments.analysis.report`: the decision report command (experiments.analysis.report.cli)."""
import sys

from experiments.analysis.report.cli import main

sys.exit(main())
