"""No secret on the console or in a log: every log record is redacted as it is made (whatever handler writes it:
Hydra's console and job-file handlers, MLflow's, ours), and the runner's stdout and stderr go through a redacting
stream (MLflow's and Hydra's own prints, tracebacks, rich's console). MLflow's "View run ... at: <tracking URI>"
lines are switched off: they print the URI as given, password included.

A quiet console (`quiet_console`): no MLflow progress bars while artifacts download, rich consoles that do not wrap
at 80 columns when their stream is not a terminal, and log records below WARNING kept to the log files (Hydra's job
log) unless `run.verbose`."""
from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

from experiments.tracking.redact import redact_text

SUPPRESS_RUN_URL_ENV = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"
PROGRESS_BAR_ENV = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
os.environ.setdefault(PROGRESS_BAR_ENV, "false")   # read by MLflow at each download: off before the first one
WIDE = 240   # columns of a rich console writing to a file or a pipe (its lines are not wrapped either)
OWN_LOGGERS = ("mlflow",)   # loggers with a console handler of their own (MLflow's; propagate=False)
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


def quiet_console(verbose: bool = False) -> None:
    """No MLflow progress bars, no wrapping at 80 columns off a terminal (every rich console loaded so far), and
    log records below WARNING to the log files only, unless `verbose`; again at each job (Hydra sets its handlers
    per job). Hydra's own lines (a sweep's job list) stay on the console. (MLflow's progress bar is off from this
    module's import.)"""
    widen_consoles()
    quiet_logs(verbose)


def widen(console) -> None:
    """A rich console on a file or a pipe: wide, lines never wrapped (one record per line for grep and CI logs)."""
    if console.is_terminal:
        return
    console.soft_wrap = True
    console.width = max(console.width, WIDE)


def widen_consoles() -> None:
    """`widen` rich's global console and every module-level one of the workspace's modules loaded so far."""
    try:
        from rich import get_console
        from rich.console import Console
    except ImportError:
        return
    widen(get_console())
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("experiments.", "sglang_patches.")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, Console):
                widen(value)


class _ConsoleFilter(logging.Filter):
    """On a console handler: WARNING and above, and Hydra's own lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.partition(".")[0] == "hydra"


def _is_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)


def quiet_logs(verbose: bool = False) -> None:
    """Log records below WARNING off the console handlers (the root's, MLflow's own), kept in the root's log files,
    which MLflow's logger is given too; `verbose` puts them back on the console."""
    try:
        import mlflow  # noqa: F401 - its import sets up its logger; a later import would undo what follows
    except ImportError:
        pass
    root = logging.getLogger()
    files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
    for handler in root.handlers:
        if _is_console(handler):
            _set_filter(handler, verbose)
    for name in OWN_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if getattr(handler, "specws_file", False) and handler not in files:
                logger.removeHandler(handler)
            elif _is_console(handler):
                _set_filter(handler, verbose)
        for handler in files:
            if handler not in logger.handlers:
                handler.specws_file = True
                logger.addHandler(handler)


def _set_filter(handler: logging.Handler, verbose: bool) -> None:
    for f in [f for f in handler.filters if isinstance(f, _ConsoleFilter)]:
        handler.removeFilter(f)
    if not verbose:
        handler.addFilter(_ConsoleFilter())
