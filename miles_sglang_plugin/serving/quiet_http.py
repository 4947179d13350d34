"""Keep the package's own HTTP requests out of the app's log.

httpx logs one INFO line per request (``HTTP Request: GET http://...``) on its ``httpx`` logger. The launcher
polls every engine's health several times a second during start-up and registers every engine with its
router, so an app logging at INFO would get hundreds of those lines. The filter installed here drops that
line for requests made from this package's code (found on the call stack of the logging call) and leaves
every other record, the app's own requests included, as it is.

It is installed where the package starts making requests, not when a module is imported: when a deployment
starts (its health polls, registrations, supervision and control fan-out; the rollout benchmark drives a
started deployment).
"""

from __future__ import annotations

import logging
import sys
from types import FrameType

PACKAGE_PREFIX = "miles_sglang_plugin."


class OwnRequestsFilter(logging.Filter):
    """Drops httpx's per-request INFO records of requests made by this package."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO:
            return True
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if str(frame.f_globals.get("__name__", "")).startswith(PACKAGE_PREFIX):
                return False
            frame = frame.f_back
        return True


def install() -> None:
    """Add the filter to the ``httpx`` logger (once per process; later calls cost a look at its filters)."""
    logger = logging.getLogger("httpx")
    if not any(isinstance(existing, OwnRequestsFilter) for existing in logger.filters):
        logger.addFilter(OwnRequestsFilter())
