"""`python -m experiments.analysis.recommend`: the recommendation command (experiments.analysis.recommend.cli)."""
import sys

from experiments.analysis.recommend.cli import main

sys.exit(main())
