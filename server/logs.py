"""Logging for the server: readable lines by default, one JSON object per line with --log-format json.

uvicorn's own loggers (including access lines) are routed through the same handler, so a log
collector sees one format.
"""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


PROBE_PATHS = frozenset({"/health", "/metrics"})


class QuietProbes(logging.Filter):
    """Access lines for health and metrics polls are debug lines: a poller every few seconds would
    otherwise fill an info log (as vLLM and llama.cpp's server keep them out of it too)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) >= 3 and str(args[2]).split("?")[0] in PROBE_PATHS:  # uvicorn's (client, method, path, ...)
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


def configure_logging(level: str, log_format: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(existing, QuietProbes) for existing in access.filters):
        access.addFilter(QuietProbes())
