"""The refusal every stage raises for an input it will not run: the message says why and what would work."""
from __future__ import annotations


class Refused(RuntimeError):
    """The run cannot start; the message says why and what would work instead."""
