"""The `graph_opt` logger's own handler: where the application configured no logging, graph_opt's lines
(a capture at a call at INFO, a fallback's warning) reach stderr at the level GRAPH_OPT_LOG_LEVEL sets,
not only warnings through logging's last resort. Where the application has a handler that would get
them (on the root logger, or on `graph_opt`, set before or after the import), this one stays silent,
so no line is printed twice."""
from __future__ import annotations

import logging
import sys

LOGGER = "graph_opt"


class FallbackHandler(logging.StreamHandler):
    """Writes to the sys.stderr of the moment (as logging.lastResort does) only while no other handler
    would get the record."""

    def __init__(self):
        logging.Handler.__init__(self)
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))

    @property
    def stream(self):
        return sys.stderr

    def handle(self, record) -> bool:
        if self._others_handle(logging.getLogger(record.name)):
            return False
        return super().handle(record)

    def _others_handle(self, logger) -> bool:
        """Whether a handler besides this one sits on the record's way up (logging's callHandlers walk)."""
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return True
            if not logger.propagate:
                return False
            logger = logger.parent
        return False


def install() -> None:
    """Add the handler to the `graph_opt` logger where the application has configured no handler (on
    the root logger or on `graph_opt`); once."""
    logger = logging.getLogger(LOGGER)
    if logging.getLogger().handlers or logger.handlers:
        return
    logger.addHandler(FallbackHandler())
