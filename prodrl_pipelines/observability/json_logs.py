"""The services' own log lines as JSON objects (``--log-format json``), the shape of the recorder's
request log: ``{"ts", "level", "service", "event", "logger"}`` plus an ``error`` when there is one.

``log_config_kwargs`` gives uvicorn a logging configuration whose every handler uses
``JsonFormatter``, so uvicorn's startup and error lines and the project's loggers come out alike."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str = "prodrl") -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname.lower(), "service": self.service, "event": record.getMessage(),
               "logger": record.name}
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"))


def log_config(service: str, level: str = "INFO") -> dict:
    """A ``logging.config.dictConfig`` for uvicorn and the root logger: JSON lines on standard error."""
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"json": {"()": JsonFormatter, "service": service}},
            "handlers": {"json": handler},
            "root": {"handlers": ["json"], "level": level.upper()},
            "loggers": {name: {"handlers": ["json"], "level": level.upper(), "propagate": False}
                        for name in ("uvicorn", "uvicorn.error", "uvicorn.access")}}


def log_config_kwargs(log_format: str, service: str) -> dict:
    """``uvicorn.Config`` keyword arguments for ``--log-format`` (text: uvicorn's own configuration)."""
    return {"log_config": log_config(service)} if log_format == "json" else {}
