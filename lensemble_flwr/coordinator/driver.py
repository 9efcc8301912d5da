"""The blocking round loop over a Transport: every transport call the coordinator makes.

A :class:`Driver` owns a :class:`~.core.RoundCore`, the transport and the clock. It runs
attempts — deliver the RoundOpens, wait in OPEN and then in COLLECTING, each until the
core's ``advance`` leaves it or its deadline passes, conclude with a masked round's
unmask exchange, announce the close — retries an aborted round as the error table
allows (:data:`lensemble_flwr.errors.RESPONSES`), and gives (re)joining participants a
moment between attempts. The core never sees the transport or the clock: the driver
hands it who is reachable, what arrived, whether a deadline passed and the time.

An attempt :meth:`Driver.open_attempt` began and delivered ahead of time is kept as an
:data:`Opened` value, which the next :meth:`Driver.run_attempt` continues.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping

from lensemble_flwr.coordinator.admission import Verdict
from lensemble_flwr.coordinator.attempt import Attempt, RoundOutcome
from lensemble_flwr.coordinator.core import RoundCore
from lensemble_flwr.coordinator.modes import Exchange, require_exchange
from lensemble_flwr.errors import (
    ConfigError,
    FaultToleranceExceeded,
    LensembleError,
    Response,
    StoreError,
    response_to,
)
from lensemble_flwr.privacy.calibration import noise_multiplier_of
from lensemble_flwr.privacy.plan import privacy_plan, shared_dim
from lensemble_flwr.protocol.messages import (
    ControlMessage,
    RoundClose,
    kind_of,
)
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.transports.base import BuffersSends, DeclaresFederation, Transport

# the coordinator's log: one name for the facade and the parts it is made of
log = logging.getLogger("lensemble_flwr.coordinator.coordinator")

_DISCOVERY_INTERVAL = 1.0
"""Seconds between looks for newly reachable participants while a round is OPEN."""

WRITES_PREPARED = 8
"""Store writes prepared as an attempt's instructions go out: a plaintext commit makes
six files (checkpoint, ledger record and its name, closing entry and its name, the
manifest entry's name) and the next attempt's marker one; more are made as needed."""


@dataclasses.dataclass(frozen=True)
class Delivered:
    """An attempt :meth:`Driver.open_attempt` began, its RoundOpens delivered."""

    attempt: Attempt


@dataclasses.dataclass(frozen=True)
class EndedOnDelivery:
    """The outcome of an attempt that ended (ABORTED) as its RoundOpens were delivered."""

    outcome: RoundOutcome


Opened = Delivered | EndedOnDelivery | None
"""What :meth:`Driver.open_attempt` left for the next :meth:`Driver.run_attempt`."""


class Driver:
    """The blocking loop over :attr:`transport`, and the steps that need the clock.

    Attributes:
        core: the round core it drives.
        transport: the coordinator's end of a :class:`Transport`; None for a feeder that
            hands in collected batches (then only the clock-bearing steps are used).
        last_close: the RoundClose of the last round this coordinator committed.
    """

    def __init__(
        self, core: RoundCore, transport: Transport | None, clock: Callable[[], float]
    ) -> None:
        self.core = core
        self.transport = transport
        self._clock = clock
        self._opened: Opened = None
        self.last_close: RoundClose | None = None
        self._plan_said = False  # the privacy plan is said once, before the first round

    # -- the steps that need the clock (or tell the participants) ----------------------
    def begin_attempt(self) -> Attempt:
        """Start the next attempt of the current round (OPEN); nothing is sent yet.

        Raises:
            IllegalTransition: the previous attempt has not ended.
            LedgerError: the attempt was already started once (attempt numbers never
                repeat; a coordinator that died mid-attempt is resumed, not reused).
            ConfigError: the transport declares fewer participants than the quorum:
                no attempt could ever reach it (nothing is started).
        """
        transport = self.transport
        declared = (
            transport.declared_size() if isinstance(transport, DeclaresFederation) else None
        )
        return self.core.begin(now=self._clock(), declared=declared)

    def conclude(self, exchange: Exchange | None = None) -> RoundOutcome:
        """AGGREGATING → ALIGNING → COMMITTING → CLOSED, or ABORTED; then announce.

        ``exchange`` carries a masked round's unmask exchange (see :mod:`.modes`).

        Raises:
            IllegalTransition: the attempt is not AGGREGATING (nothing changes).
            Exception: a failure to write the manifest entry after the commit point, once
                the CLOSED outcome is recorded and the round announced (the run's store
                is failing: stop; resume completes the entry from the kept closing one).
        """
        self.core.aggregating()
        try:
            self._unmask(exchange)
        except LensembleError as exc:
            return self.abort(exc)
        concluded = self.core.conclude()
        if isinstance(concluded, LensembleError):
            return self.abort(concluded)
        outcome = self.core.outcome(
            concluded.attempt, concluded.result, concluded.diagnostics, None, now=self._clock()
        )
        self.last_close = concluded.close
        self._announce(concluded.close)
        self.core.report(outcome)
        if concluded.failure is not None:
            raise concluded.failure  # the store is failing: stop; the round stays committed
        return outcome

    def _unmask(self, exchange: Exchange | None) -> None:
        """A masked round's exchanges before its sum is revealed: the survivor check when
        somebody dropped, then the unmask requests; the core's messages go out through
        ``exchange``, which admits the answers (nothing in a plaintext round).

        Raises:
            ConfigError: the round is masked and there is no ``exchange``.
            LensembleError: a request could not be formed, or an answer stopped the round.
        """
        require_exchange(self.core.mode, exchange)
        check = self.core.survivor_check()
        if check is not None:
            assert exchange is not None  # require_exchange: a masked round has one
            exchange(check.requests, check.done)
        unmask = self.core.unmask()
        if unmask is not None:
            assert exchange is not None  # require_exchange: a masked round has one
            exchange(unmask.requests, unmask.done)

    def abort(self, error: LensembleError) -> RoundOutcome:
        """End the current attempt ABORTED with ``error``; the global state is untouched."""
        return self.core.abort(error, now=self._clock())

    def retry_allowed(self, outcome: RoundOutcome) -> bool:
        """Whether the error table and the attempt limit let ``outcome``'s round be retried."""
        return (
            outcome.error is not None
            and response_to(outcome.error) is Response.RETRY_ROUND
            and outcome.attempt < self.core.config.federation.max_round_attempts
        )

    # -- the blocking loop -------------------------------------------------------------
    def run(self, num_rounds: int) -> None:
        """Drive ``num_rounds`` rounds to CLOSED, retrying aborted rounds per the error table.

        Raises:
            ConfigError: under DP, the rounds up to ``target`` would take each
                participant past its budget (checked before any of them).
            LensembleError: the error of an attempt whose response is to stop the
                federation, or the last error once ``max_round_attempts`` is used up.
        """
        if num_rounds < 0:
            raise ValueError("num_rounds must be >= 0")
        target = self.core.run.head.state.round + num_rounds
        noise_multiplier_of(self.core.config, rounds=target)
        if not self._plan_said and self.transport is not None:
            self._plan_said = True
            self._say_plan(target)
        while self.core.run.head.state.round < target:
            outcome = self.run_attempt()
            if outcome.state is RoundState.CLOSED:
                continue
            assert outcome.error is not None
            if self.retry_allowed(outcome):
                log.info("round %d: retrying after %s", outcome.round, outcome.reason)
                self._wait_for_joins()
                continue
            log.error("round %d: federation stops: %s", outcome.round, outcome.reason)
            raise outcome.error

    def run_attempt(self) -> RoundOutcome:
        """Run one attempt of the current round over :attr:`transport`, without retrying.

        The phase loop: wait in OPEN, then in COLLECTING, each until ``advance`` leaves
        it or its deadline passes; then conclude the attempt.
        """
        self._require_transport()
        opened, self._opened = self._opened, None
        if isinstance(opened, EndedOnDelivery):
            return opened.outcome  # open_attempt's attempt ended as it was delivered
        if (
            isinstance(opened, Delivered)
            and opened.attempt is self.core.attempt
            and opened.attempt.phase is RoundState.OPEN
        ):
            attempt = opened.attempt
        else:
            attempt = self.begin_attempt()
            failed = self._deliver_invitations(attempt)
            if failed is not None:
                return failed
        try:
            self._wait_out_phases(attempt)
        except LensembleError as exc:
            return self.abort(exc)
        return self.conclude(exchange=self._exchange)

    def _wait_out_phases(self, attempt: Attempt) -> None:
        """OPEN, then COLLECTING: invite, look whether the phase is over, wait for a
        message (in OPEN, at most a discovery interval: new peers are looked for)."""
        transport = self._require_transport()
        deadlines = attempt.start_waiting(self._clock())
        phases = ((deadlines.open, _DISCOVERY_INTERVAL), (deadlines.collect, None))
        for timeout, poll in phases:
            deadline = self._clock() + timeout + attempt.grace
            while True:
                self._send_all(self.core.invite(transport.peers()))
                remaining = deadline - self._clock()
                # who is reachable once the invitations went out (delivering a
                # RoundOpen can take a participant offline, or bring one back)
                if self.core.advance(transport.peers(), deadline_passed=remaining <= 0):
                    break
                wait = remaining if poll is None else min(remaining, poll)
                if self.core.receive(transport.recv(timeout_s=wait)) is Verdict.ADMITTED:
                    attempt.note_admitted(self._clock())

    def open_attempt(self) -> None:
        """Begin the next attempt and deliver its RoundOpens now, without waiting for a
        reply: the next :meth:`run_attempt` (or :meth:`run`) continues this attempt
        rather than beginning another. A caller with work of its own between rounds (the
        Flower strategy's metrics and log lines of the round just committed) does it while
        the participants train. The deadlines start when ``run_attempt`` starts waiting:
        time spent before that is not taken from the participants. Keep that time short
        over a transport whose messages expire (a Flower SuperLink drops an instruction,
        and its reply, once its TTL has passed).

        An error delivering the RoundOpens ends the attempt ABORTED, as in
        ``run_attempt``, which then returns that outcome (and ``run`` retries or stops
        per the error table); an error that is not a round's (a SuperLink out of reach)
        ends it ABORTED too, and is raised.

        Raises:
            IllegalTransition, LedgerError, ConfigError: as :meth:`begin_attempt` (nothing
                is started).
            ConfigError: under DP, the rounds up to this one would take a participant past
                its budget (as :meth:`run` checks; nothing is started).
        """
        self._require_transport()
        noise_multiplier_of(self.core.config, rounds=self.core.run.head.state.next_round)
        attempt = self.begin_attempt()
        failed = self._deliver_invitations(attempt)
        self._opened = EndedOnDelivery(failed) if failed is not None else Delivered(attempt)

    def _say_plan(self, rounds: int) -> None:
        """Log a noised run's privacy plan and forecast (:mod:`..privacy.plan`), with a
        warning when the forecast says the model cannot learn, before its first round."""
        config = self.core.config
        if not config.privacy.noised:
            return
        reachable = len(self._require_transport().peers())
        fed = config.federation
        contributors = fed.sample_size(reachable) if fed.sampled else reachable
        state = self.core.run.head.state
        plan = privacy_plan(
            config,
            rounds=rounds,
            participants=max(contributors, fed.quorum),
            dim=shared_dim(state.params, config),
        )
        assert plan is not None  # noised
        for line in plan.lines():
            log.info("%s", line)
        warning = plan.warning()
        if warning is not None:
            log.warning("%s", warning)

    # -- transport calls ---------------------------------------------------------------
    def _require_transport(self) -> Transport:
        if self.transport is None:
            raise ConfigError("transport", "the blocking round loop needs a transport")
        return self.transport

    def _deliver_invitations(self, attempt: Attempt) -> RoundOutcome | None:
        """Send the attempt's first RoundOpens and push them out; then make the files the
        round will write. The outcome if that ended the attempt (ABORTED), else None."""
        transport = self._require_transport()
        try:
            self._send_all(self.core.invite(transport.peers()))
            if isinstance(transport, BuffersSends):
                transport.deliver_queued()  # the instructions go out before anything else
            self._prepare_writes()
            on_transition = self.core.observers.on_transition
            if on_transition is not None:
                on_transition(attempt.machine)  # OPEN, its RoundOpens delivered
        except LensembleError as exc:
            return self.abort(exc)
        except Exception as exc:  # not a round's error (a SuperLink out of reach): the
            # attempt is over all the same, so that a later run begins the next one
            self.abort(
                FaultToleranceExceeded(
                    f"its RoundOpens could not be sent: {type(exc).__name__}: {exc}"
                )
            )
            raise
        return None

    def _prepare_writes(self) -> None:
        """Make now, while the round's instructions are out and its replies are awaited,
        the files the commit and the next attempt's marker will write, so that they are
        not made between this round's last reply and the next round's instructions
        (``Store.prepare_writes``). Only a saving: if it fails, the writes make their
        own files, and the failure is logged."""
        try:
            self.core.store.prepare_writes(WRITES_PREPARED)
        except StoreError as exc:
            log.warning("round writes not prepared ahead (they make their own files): %s", exc)

    def _send_all(self, messages: Iterable[tuple[str, ControlMessage]]) -> None:
        transport = self._require_transport()
        for peer, message in messages:
            transport.send(peer, message)

    def _exchange(self, requests: Mapping[str, ControlMessage], done: Callable[[], bool]) -> None:
        """A further exchange within the attempt (a masked round's survivor check or
        unmask requests), over the transport, until ``done()`` or the collect timeout
        passed."""
        transport = self._require_transport()
        self._send_all(requests.items())
        attempt = self.core.current()
        deadlines = attempt.deadlines or self.core.deadlines.next()
        deadline = self._clock() + deadlines.collect
        while not done() and (remaining := deadline - self._clock()) > 0:
            self.core.receive(transport.recv(timeout_s=remaining))

    def _announce(self, close: RoundClose) -> None:
        """Tell every participant the round closed. It is committed already: a failure
        here is logged, and participants learn the new state from the next RoundOpen."""
        if self.transport is None:
            return  # a batch feeder sends the close with its next instructions
        try:
            self.transport.broadcast(close)
        except Exception as exc:
            log.error("round %d is committed, but RoundClose was not sent: %r", close.round, exc)

    def _wait_for_joins(self) -> None:
        """Give (re)joining participants ``retry_wait`` seconds; drop what arrives."""
        transport = self._require_transport()
        deadline = self._clock() + self.core.config.federation.retry_wait
        while (remaining := deadline - self._clock()) > 0:
            payload = transport.recv(timeout_s=remaining)
            if payload is not None:
                log.info("between attempts: dropped a %s", kind_of(payload) or "message")
