"""Replies the coordinator no longer waits for, counted and said once per attempt.

A node that answers after its instruction's TTL passed sends a reply whose own TTL is
spent: Flower's SuperLink refuses to store it and logs an ERROR line for each
(``['`metadata.ttl` must be higher than zero', 'Message TTL has expired']``). Pulling the
replies of an instruction that expired unanswered gives a "Message Unavailable" error
reply from the SuperLink. For an attempt the coordinator has stopped waiting for (it
closed or aborted at its deadline), neither says anything new: :class:`ExpiredReplies`
counts them, and the round loop says the counts in one INFO line as each attempt ends.
Every other error stays as it was: an ERROR line of Flower's that holds anything else
is let through, and a "Message Unavailable" for the attempt still awaited remains that
node's refusal, logged as a warning.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from flwr.common.constant import ErrorCode
from flwr.common.logger import FLOWER_LOGGER

TTL_ERRORS = frozenset({"`metadata.ttl` must be higher than zero", "Message TTL has expired"})
"""What Flower's SuperLink logs (as a list, at ERROR) for a reply whose TTL is spent."""

UNAVAILABLE = frozenset({ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE})
"""The SuperLink's error codes for an instruction, or a reply, that expired."""


def expired_only(record: logging.LogRecord) -> bool:
    """Whether ``record`` is Flower's ERROR line for a reply whose TTL had passed, and
    nothing else (a list of validation errors that are all :data:`TTL_ERRORS`)."""
    errors = record.msg
    return (
        record.levelno >= logging.ERROR
        and isinstance(errors, list)
        and bool(errors)
        and all(isinstance(e, str) and e in TTL_ERRORS for e in errors)
    )


class ExpiredReplies(logging.Filter):
    """Counts late replies Flower dropped and unavailable ones of past attempts.

    Attributes:
        dropped: Flower's ERROR lines for replies whose TTL had passed, held back since
            the last :meth:`say`.
        unavailable: "Message Unavailable" replies to instructions of attempts no longer
            awaited, since the last :meth:`say`.
        total: every reply counted over the run.
    """

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0
        self.unavailable = 0
        self.total = 0

    def filter(self, record: logging.LogRecord) -> bool:
        """Hold back (and count) Flower's line for a reply whose TTL passed; let every
        other record through."""
        if expired_only(record):
            self.dropped += 1
            self.total += 1
            return False
        return True

    def count_unavailable(self) -> None:
        """One more "Message Unavailable" reply for an attempt no longer awaited."""
        self.unavailable += 1
        self.total += 1

    def say(self, round: int, attempt: int) -> None:
        """One INFO line with what was counted since the last one (none if nothing was),
        as attempt ``attempt`` of round ``round`` ends; the counts start again."""
        if not (self.dropped or self.unavailable):
            return
        FLOWER_LOGGER.info(  # among Flower's lines of the round, as the round loop's are
            "round %d attempt %d: %d late replies dropped by Flower (their TTL had passed) "
            "and %d expired instructions reported unavailable by the SuperLink, all of "
            "attempts no longer waited for",
            round,
            attempt,
            self.dropped,
            self.unavailable,
        )
        self.dropped = self.unavailable = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[ExpiredReplies]:
        """Within the block, Flower's lines for expired replies are counted, not logged."""
        FLOWER_LOGGER.addFilter(self)
        try:
            yield self
        finally:
            FLOWER_LOGGER.removeFilter(self)
