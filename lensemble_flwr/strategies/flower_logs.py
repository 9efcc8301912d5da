"""lensemble's own warnings, shown as Flower shows its lines, for the length of a run.

Importing lensemble-flwr configures no logging. Its modules log to their own loggers
(``lensemble_flwr.*``); when nothing configured logging, Python prints their warnings
through its last-resort handler: the bare message, no level, no time, between Flower's
formatted lines. While :meth:`LensembleStrategy.start
<lensemble_flwr.strategies.lensemble.LensembleStrategy.start>` runs, and only when
neither the root logger nor the package's has a handler, those warnings (and errors) go
to Flower's console handlers instead. A logging configuration of the user's own is left
alone.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from flwr.common.logger import FLOWER_LOGGER

__all__ = ["lensemble_logs_through_flower"]

PACKAGE_LOGGER = "lensemble_flwr"


class _ToFlowersHandlers(logging.Handler):
    """Hands a record to the handlers of Flower's logger (each at its own level)."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in FLOWER_LOGGER.handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


@contextlib.contextmanager
def lensemble_logs_through_flower() -> Iterator[None]:
    """Within the block, lensemble's warnings and errors reach Flower's handlers when no
    handler would take them otherwise (see the module)."""
    package = logging.getLogger(PACKAGE_LOGGER)
    if package.handlers or logging.getLogger().handlers or not FLOWER_LOGGER.handlers:
        yield
        return
    handler = _ToFlowersHandlers(logging.WARNING)
    package.addHandler(handler)
    try:
        yield
    finally:
        package.removeHandler(handler)
