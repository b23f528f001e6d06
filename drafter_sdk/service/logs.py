"""How both services log: `--log-level`, and `--log-format` text (a line a record, for a terminal and
`kubectl logs`) or json (an object a line, for a log pipeline: Loki, Elasticsearch, Cloud Logging),
set up once per process on the root logger, which the libraries' loggers (uvicorn's included) and
their warnings propagate to. (gRPC's C core logs apart from them: grpc_core_logs.py.)"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from datetime import datetime, timezone

LOG_FORMATS = ("text", "json")


def add_logging_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("logging")
    group.add_argument("--log-level", default="INFO", help="(default: INFO)")
    group.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                       help="text: a line a record; json: one JSON object a line (time, level, logger, message, "
                            "exception), for a log pipeline (default: text)")


def configure_logging(level: str, log_format: str, **fields: object) -> None:
    """Log records of `level` and above to stderr in `log_format`; `fields` (a rank under tensor
    parallelism) go on every record."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(_JsonFormatter(fields))
        _no_progress_bars()
    else:
        shown = "".join(f"{name} {value} " for name, value in fields.items())
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {shown}%(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    logging.captureWarnings(True)  # a library's warnings.warn, in the same format (not a bare stderr line)


def _no_progress_bars() -> None:
    """Hugging Face's progress bars (a model's weights loading) write lines no log pipeline can parse."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read where huggingface_hub is imported later
    if (hub := sys.modules.get("huggingface_hub")) is not None:
        hub.utils.disable_progress_bars()
    if (transformers := sys.modules.get("transformers")) is not None:  # took hub's setting when imported
        transformers.utils.logging.disable_progress_bar()


class _JsonFormatter(logging.Formatter):
    def __init__(self, fields: dict[str, object]) -> None:
        super().__init__()
        self._fields = fields

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
                 "level": record.levelname, "logger": record.name, "message": record.getMessage(), **self._fields,
                 **getattr(record, "structured", {})}  # a record's own fields: extra={"structured": {...}}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)
