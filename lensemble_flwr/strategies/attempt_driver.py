"""What ``LensembleStrategy.start`` adds around Flower's round hooks within one attempt.

Flower's own loop sends what ``configure_train`` returned, waits for replies until one
timeout, and hands them all to ``aggregate_train``. :class:`AttemptDriver` drives the
attempt between those two hooks as the coordinator's own blocking loop does:

* :meth:`~AttemptDriver.push`: the instructions ``configure_train`` returned go out
  through the :class:`~lensemble_flwr.strategies.grid_transport.GridTransport`; an
  instruction that an override left out is that node's refusal (it was never sent);
* :meth:`~AttemptDriver.collect`: the attempt's OPEN and COLLECTING phases, each to its
  deadline (plus the first attempt's grace); a node that connects meanwhile is invited,
  and each reply is decoded by the transport and admitted as it arrives (validated, its
  arrays hashed once);
* :meth:`~AttemptDriver.conclude`: the attempt's end, with a masked round's unmask
  exchange (a second exchange within the attempt, which Flower's loop cannot make);
  once it closed, :attr:`~AttemptDriver.on_closed` (the round loop's chance to push
  the next round's instructions before the round's metrics are made);
* :meth:`~AttemptDriver.wait_for_joins`: ``retry-wait`` between a round's attempts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from flwr.app import Message

from lensemble_flwr.coordinator.admission import Verdict
from lensemble_flwr.coordinator.attempt import Attempt, RoundOutcome
from lensemble_flwr.coordinator.coordinator import WRITES_PREPARED, Coordinator
from lensemble_flwr.errors import LensembleError, StoreError
from lensemble_flwr.protocol.messages import ControlMessage, kind_of
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.strategies.grid_transport import GridTransport, unsent_refusal

log = logging.getLogger(__name__)

DISCOVERY_INTERVAL = 1.0
"""Seconds between looks for newly connected nodes while an attempt is OPEN."""


class AttemptDriver:
    """Drives the coordinator's current attempt over a GridTransport (see the module)."""

    def __init__(self, coordinator: Coordinator, transport: GridTransport) -> None:
        self._coordinator = coordinator
        self._transport = transport
        self._attempt: Attempt | None = None  # the attempt this driver drives
        self._outcome: RoundOutcome | None = None  # and how it ended, once it did
        self._reply_ids: frozenset[int] = frozenset()  # the replies take_replies took (ids)
        # called with the outcome once :meth:`conclude` closed an attempt (the round loop
        # opens the next round there when no code of the user's comes in between)
        self.on_closed: Callable[[RoundOutcome], None] | None = None

    def drives(self, attempt: Attempt | None) -> bool:
        """Whether ``attempt`` is the one this driver pushed (its replies are admitted
        as they arrive, and :meth:`conclude` ends it)."""
        return attempt is not None and attempt is self._attempt

    @property
    def outcome(self) -> RoundOutcome | None:
        """How the driven attempt ended (None while it has not)."""
        return self._outcome

    def take_over(self, attempt: Attempt) -> None:
        """Drive ``attempt`` from now on (:meth:`push` does it first)."""
        if attempt is not self._attempt:
            self._attempt, self._outcome, self._reply_ids = attempt, None, frozenset()
        self._transport.awaited = (attempt.round, attempt.number)

    def push(self, messages: Iterable[Message], attempt: Attempt) -> None:
        """Send ``messages`` as ``attempt``'s instructions, then make the files its commit
        will write (while the nodes train); a node whose instruction was left out
        refuses the attempt at once."""
        self.take_over(attempt)
        left_out = self._transport.push_instructions(messages, attempt.round_open)
        try:
            self._coordinator.store.prepare_writes(WRITES_PREPARED)
        except StoreError as exc:  # only a saving: the writes make their own files
            log.warning("round writes not prepared ahead (they make their own files): %s", exc)
        try:
            for info in left_out:
                self._coordinator.receive(unsent_refusal(info))
        except LensembleError as exc:
            self.abort(exc)

    @property
    def reply_ids(self) -> frozenset[int]:
        """The ``id()`` of each reply :meth:`take_replies` last took (a reply pulled from
        a SuperLink may carry no message id of its own)."""
        return self._reply_ids

    def take_replies(self) -> list[Message]:
        """The driven attempt's replies (errors included), in arrival order: what
        ``aggregate_train`` is handed."""
        attempt = self._attempt
        if attempt is None:
            return []
        replies = self._transport.take_train_replies(attempt.round, attempt.number)
        self._reply_ids = frozenset(id(reply) for reply in replies)
        return replies

    def abort(self, error: LensembleError) -> RoundOutcome:
        """End the driven attempt ABORTED with ``error``."""
        self._outcome = self._coordinator.abort(error)
        self._transport.awaited = None  # its replies are no longer waited for
        return self._outcome

    def collect(self) -> None:
        """OPEN, then COLLECTING, each until the coordinator leaves it or its deadline
        passes; a typed error on the way ends the attempt ABORTED (:attr:`outcome`)."""
        coordinator, transport = self._coordinator, self._transport
        attempt = self._attempt
        if attempt is None or self._outcome is not None:
            return
        try:
            deadlines = attempt.start_waiting(transport.now())
            phases = ((deadlines.open, DISCOVERY_INTERVAL), (deadlines.collect, None))
            for timeout, poll in phases:
                deadline = transport.now() + timeout + attempt.grace
                while True:
                    for peer, round_open in coordinator.invite(transport.peers()):
                        transport.send(peer, round_open)
                    remaining = deadline - transport.now()
                    if coordinator.advance(transport.peers(), deadline_passed=remaining <= 0):
                        break
                    wait = remaining if poll is None else min(remaining, poll)
                    payload = transport.recv(timeout_s=wait)
                    if coordinator.receive(payload) is Verdict.ADMITTED:
                        attempt.note_admitted(transport.now())
        except LensembleError as exc:
            self.abort(exc)

    def conclude(self) -> RoundOutcome:
        """End the driven attempt: its outcome if it ended already, else the coordinator
        concludes it (AGGREGATING → CLOSED or ABORTED) with the unmask exchange."""
        if self._outcome is not None:
            return self._outcome
        outcome = self._outcome = self._coordinator.conclude(exchange=self._exchange)
        self._transport.awaited = None  # its replies are no longer waited for
        on_closed, self.on_closed = self.on_closed, None
        if on_closed is not None and outcome.state is RoundState.CLOSED:
            on_closed(outcome)  # it may push the next attempt: this driver drives that one
        return outcome

    def _exchange(self, requests: Mapping[str, ControlMessage], done: Callable[[], bool]) -> None:
        """A masked round's survivor check or unmask requests, and their answers admitted
        until ``done()`` or the collect timeout."""
        coordinator, transport = self._coordinator, self._transport
        for peer, request in requests.items():
            transport.send(peer, request)
        attempt = coordinator.core.current()
        deadlines = attempt.deadlines or coordinator.core.deadlines.next()
        deadline = transport.now() + deadlines.collect
        while not done() and (remaining := deadline - transport.now()) > 0:
            coordinator.receive(transport.recv(timeout_s=remaining))

    def release(self) -> None:
        """The run is over: the transport keeps no more replies, nor this driver."""
        self._transport.keep_train_replies = False
        self._transport.take_train_replies(-1, -1)
        self._attempt, self._reply_ids = None, frozenset()

    def wait_for_joins(self) -> None:
        """Give (re)joining nodes ``retry-wait`` seconds before the next attempt; what
        arrives meanwhile is dropped."""
        transport = self._transport
        deadline = transport.now() + self._coordinator.config.federation.retry_wait
        while (remaining := deadline - transport.now()) > 0:
            payload = transport.recv(timeout_s=remaining)
            if payload is not None:
                log.info("between attempts: dropped a %s", kind_of(payload) or "message")
