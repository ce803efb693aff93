"""Structured logs: one line per record with the request / session id it concerns, as JSON
(`--log-format json`, for collectors) or as key=value text. Ids ride `extra={"request_id": ...}`;
`key_id` is an API key's id from the keys file, never the key."""

from __future__ import annotations

import json
import logging
import os
import time

CONTEXT_KEYS = ("request_id", "session_id", "key_id", "status", "finish_reason", "ttfp_ms", "audio_s", "rtf", "error")
# Third-party noise at start-up, shown only with --log-level debug: transformers warns that Qwen3-Omni's own
# config carries rope keys its default rope type does not read (harmless: the model reads them itself).
QUIET_LOGGERS = ("transformers.modeling_rope_utils",)


class StructuredFormatter(logging.Formatter):
    def __init__(self, as_json: bool):
        super().__init__()
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        fields = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{record.msecs:03.0f}Z",
                  "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        fields.update({k: getattr(record, k) for k in CONTEXT_KEYS if getattr(record, k, None) is not None})
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)  # the log keeps it; error bodies never do
        if self.as_json:
            return json.dumps(fields, default=str)
        ctx = " ".join(f"{k}={fields[k]}" for k in CONTEXT_KEYS if k in fields)
        text = f"{fields['ts']} {record.levelname} {record.name}: {fields['msg']}" + (f" [{ctx}]" if ctx else "")
        return text + (f"\n{fields['exc']}" if "exc" in fields else "")


def setup(level: str, fmt: str) -> None:
    """Logging for this process (the API process, and the engine core's, before it imports transformers)."""
    handler = logging.StreamHandler()
    handler.setFormatter(StructuredFormatter(as_json=fmt == "json"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)
    if level != "debug":
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bar
