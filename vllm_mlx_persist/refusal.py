"""A start-up refusal of persist_q4 printed as one line.

uvicorn logs a failed start-up as the whole traceback; for a refusal of ours (a bad option, a model
it cannot serve, a cache directory another server holds) the message says everything. `refuse`
adds a filter to uvicorn's error logger that reduces that record to the message. Used by the
backend factory at start-up (the event-loop thread); the filters it adds are its only state.
"""

from __future__ import annotations

import logging


class _OneLineRefusal(logging.Filter):
    """uvicorn logs a failed start-up as the whole traceback; for a refusal of ours the message says
    everything, so that record is reduced to it (other records pass untouched)."""

    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        if isinstance(msg, str) and msg.startswith("Traceback") and msg.rstrip().endswith(self.message):
            record.msg, record.args, record.exc_info, record.exc_text = self.message, (), None, None
        return True


def refuse(e: ValueError) -> ValueError:
    """Make the start-up failure that `e` causes print as one line; returns `e` to raise."""
    logging.getLogger("uvicorn.error").addFilter(_OneLineRefusal(str(e).strip()))
    return e
