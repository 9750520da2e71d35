"""No secret on the console or in a log: every log record is redacted as it is made (whatever handler writes it:
Hydra's console and job-file handlers, MLflow's, ours), and the runner's stdout and stderr go through a redacting
stream (MLflow's and Hydra's own prints, tracebacks, rich's console). MLflow's "View run ... at: <tracking URI>"
lines are switched off: they print the URI as given, password included."""
from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

from experiments.tracking.redact import redact_text

SUPPRESS_RUN_URL_ENV = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"
_PENDING_LIMIT = 1 << 16   # a partial line longer than this is written out as it is, redacted


class RedactingStream:
    """A text stream that writes `stream` redacted, a line at a time (a secret split over two writes of one line
    is still found); the partial line left is written on flush."""

    def __init__(self, stream: TextIO) -> None:
        self._stream, self._pending = stream, ""

    @property
    def wrapped(self) -> TextIO:
        return self._stream

    def write(self, text: str) -> int:
        pending = self._pending + text
        done, newline, rest = pending.rpartition("\n")
        if newline:
            self._stream.write(redact_text(done + newline))
        self._pending = rest
        if len(self._pending) > _PENDING_LIMIT:
            self._stream.write(redact_text(self._pending))
            self._pending = ""
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self._pending:
            self._stream.write(redact_text(self._pending))
            self._pending = ""
        self._stream.flush()

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._stream, name)


def _redacting_factory(make):
    def factory(*args, **kwargs) -> logging.LogRecord:
        record = make(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record: logging reports it itself
            return record
        redacted = redact_text(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
            text = logging.Formatter().formatException(record.exc_info)
            if redact_text(text) != text:
                record.exc_text = redact_text(text)
        return record
    factory.redacting = True
    return factory


def redact_logs() -> None:
    """Every log record made from now on is redacted (message, arguments, traceback), and MLflow prints no run
    URL; idempotent. Safe inside a test process: it changes no stream."""
    os.environ[SUPPRESS_RUN_URL_ENV] = "true"
    make = logging.getLogRecordFactory()
    if not getattr(make, "redacting", False):
        logging.setLogRecordFactory(_redacting_factory(make))


def guard_console() -> None:
    """redact_logs, and this process's stdout and stderr redacted; for the runner's entry point (idempotent)."""
    redact_logs()
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, RedactingStream):
            setattr(sys, name, RedactingStream(stream))
