"""``LensembleStrategy.start``: one Flower round loop, and what Flower's loop cannot do.

Every round calls the strategy's own hooks, in the order of Flower's ``Strategy.start``::

    configure_train -> (instructions out, replies in) -> aggregate_train
    configure_evaluate -> (instructions out, replies in) -> aggregate_evaluate -> evaluate_fn

Around the hooks (:class:`~.attempt_driver.AttemptDriver`), what Flower's loop cannot do:
the instructions go out through the strategy's GridTransport and each reply is admitted
as it arrives (validated, hashed once); each attempt keeps its open and collect
deadlines (the first round gets what the warm-up left as grace), and a node that connects
meanwhile is invited; a masked round's unmask exchange happens within the attempt (in the
default ``aggregate_train``); an aborted attempt is retried as the error table and
``max-round-attempts`` say, after ``retry-wait``, as the same round (``server_round``
does not move on); and with no code of the user's between two rounds, the next round's
instructions go out before this round's metrics and lines are written (with none in the
round hooks either, as soon as the round closes, before ``aggregate_train`` makes the
round's metrics and returned arrays).

What a subclass's override changes:

* ``configure_train`` returns fewer instructions than it was handed: the nodes left out
  were invited and never sent anything; each refuses the attempt at once.
* ``configure_train`` returns Messages of its own: each goes out as the attempt's
  instruction to its node (a node invited later in the attempt gets lensemble's).
* ``aggregate_train`` hands the default fewer replies than came: every reply was
  admitted as it arrived, so the left-out ones are in the round all the same (logged).
* ``aggregate_train`` does not call the default: lensemble ends the attempt itself over
  what it admitted (logged), and the round is committed as usual.
* ``aggregate_train`` returns other arrays: the next round trains from them, recorded as
  its external step; after the last round they are ``result.arrays`` only (logged).

Before round 1 the run is opened, the nodes are warmed up and the initial model is
evaluated; if any of it fails, the run is taken back (:mod:`.run_dir`). Each round's
train, federated-evaluation and ``evaluate_fn`` metrics (and the initial model's, as
round 0) go to ``RUN_DIR/round-metrics.jsonl`` once the round is reported.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from logging import INFO
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.common import log as say
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords, log_strategy_start_info

from lensemble_flwr.aggregation import recycling
from lensemble_flwr.config import metrics_released
from lensemble_flwr.coordinator.attempt import RoundOutcome
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.errors import FaultToleranceExceeded, LensembleError
from lensemble_flwr.privacy.calibration import noise_multiplier_of
from lensemble_flwr.privacy.plan import privacy_plan, shared_dim
from lensemble_flwr.protocol.round import TERMINAL_STATES, RoundState
from lensemble_flwr.strategies import reporting
from lensemble_flwr.strategies.attempt_driver import AttemptDriver
from lensemble_flwr.strategies.expired import ExpiredReplies
from lensemble_flwr.strategies.flower_logs import lensemble_logs_through_flower
from lensemble_flwr.strategies.grid_transport import instruction_ttl
from lensemble_flwr.strategies.reporting import LensembleResult
from lensemble_flwr.strategies.warm_up import warm_up

if TYPE_CHECKING:
    from lensemble_flwr.strategies.lensemble import LensembleStrategy

log = logging.getLogger(__name__)

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


class RoundLoop:
    """One run of :meth:`LensembleStrategy.start` (see the module); a part of the
    strategy kept apart, which reads the strategy's private settings."""

    def __init__(
        self,
        strategy: LensembleStrategy,
        grid: Grid,
        timeout: float,
        train_config: ConfigRecord | None,
        evaluate_config: ConfigRecord | None,
        evaluate_fn: EvaluateFn | None,
    ) -> None:
        self._strategy, self._grid, self._timeout = strategy, grid, timeout
        self._train_config = ConfigRecord() if train_config is None else train_config
        self._round_config: tuple[int, ConfigRecord] | None = None  # as round r began
        self._evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        self._logged_configs = (train_config, evaluate_config)
        self._evaluate_fn = evaluate_fn
        self._arrays = ArrayRecord()  # what the next configure_train is handed
        self._opened_ahead = False  # the next round's first attempt is out already
        # the next round was opened as this one closed (in aggregate_train), and what
        # opening it raised, to be raised once this round is reported
        self._opened_on_close = False
        self._not_opened: Exception | None = None
        self._closed: RoundOutcome | None = None  # the outcome the driver closed with
        self._expired = ExpiredReplies()  # late replies of attempts no longer awaited

    def run(self, initial_arrays: ArrayRecord, num_rounds: int) -> LensembleResult:
        """The rounds up to ``num_rounds`` (see :meth:`LensembleStrategy.start`)."""
        strategy = self._strategy
        with lensemble_logs_through_flower(), self._expired.counting():
            noise_multiplier_of(strategy._config, rounds=num_rounds)  # a plan that fits
            say(INFO, "Starting %s strategy:", type(strategy).__name__)
            log_strategy_start_info(num_rounds, initial_arrays, *self._logged_configs)
            strategy.summary()
            say(INFO, "")
            started = time.time()
            coordinator, driver, result = self._begin(initial_arrays, num_rounds)
            strategy._driver = driver
            try:
                self._rounds(coordinator, driver, result, num_rounds)
            finally:  # the temp files made ahead of writes can go, however the run ended
                strategy._driver = None
                driver.release()
                coordinator.store.close()
            self._check_final_arrays(coordinator, result)
            recycling.clear()  # the run is over: the last sum's buffers need not stay resident
            reporting.log_final(result, started)
            return result

    # -- before round 1 ----------------------------------------------------------------
    def _begin(
        self, initial_arrays: ArrayRecord, num_rounds: int
    ) -> tuple[Coordinator, AttemptDriver, LensembleResult]:
        """Open the run, warm up, evaluate the initial model: taken back if any fails."""
        strategy = self._strategy
        fed = strategy._config.federation
        transport = strategy._new_transport(
            self._grid, initial_arrays, fed.open_timeout + fed.collect_timeout
        )
        transport.user_config = dict(self._train_config)
        transport.expired = self._expired
        with strategy._place.undone_if_it_fails():  # before round 1: a failure leaves no run
            coordinator = strategy._open_run(self._grid, initial_arrays, transport)
            result = LensembleResult(arrays=initial_arrays, run_dir=strategy._place.path)
            done = coordinator.global_state().round
            waited = warm_up(
                transport,
                fed,
                strategy._warmup_timeout,
                done=done,
                num_rounds=num_rounds,
                run_dir=strategy._place.path,
            )
            # The first round's deadlines get the rest of the warm-up budget as grace (a
            # round in which every invited node answered ends at once), and its
            # instructions may wait in the SuperLink as long: an instruction that expired
            # before a cold ClientApp picked it up would lose the node the round
            self._say_plan(coordinator, num_rounds, done)
            grace = max(0.0, strategy._warmup_timeout - waited)
            coordinator.grant_grace(grace)
            transport.message_ttl = instruction_ttl(coordinator.core.deadlines.next(), grace)
            self._evaluate_initial(coordinator, initial_arrays, result)
        if 0 in result.evaluate_metrics_serverapp:  # the initial model's, once the run stays
            strategy._keep_metrics(0, MetricRecord(), None, result.evaluate_metrics_serverapp[0])
        self._arrays = initial_arrays
        if done > 0:  # resumed: the run's model, whether or not a round is left to run
            self._arrays = result.arrays = strategy._user_arrays(coordinator.global_state().params)
        strategy._returned = self._arrays
        transport.keep_train_replies = True
        return coordinator, AttemptDriver(coordinator, transport), result

    def _say_plan(self, coordinator: Coordinator, num_rounds: int, done: int) -> None:
        """The privacy plan and its forecast for the nodes the warm-up found (a round's
        sample of them), before round 1 (:func:`reporting.log_privacy_plan`)."""
        config = self._strategy._config
        transport = self._strategy._transport
        if not config.privacy.noised or done >= num_rounds or transport is None:
            return
        fed = config.federation
        connected = len(transport.peers(fresh=True))
        reporting.log_privacy_plan(
            privacy_plan(
                config,
                rounds=num_rounds,
                participants=max(fed.sample_size(connected), fed.quorum),
                dim=shared_dim(coordinator.global_state().params, config),
            )
        )

    def _evaluate_initial(
        self, coordinator: Coordinator, initial_arrays: ArrayRecord, result: LensembleResult
    ) -> None:
        if self._evaluate_fn is None or coordinator.global_state().round > 0:  # resumed
            return
        res = self._evaluate_fn(0, initial_arrays)
        say(INFO, "Initial global evaluation results: %s", res)
        if res is not None:
            result.evaluate_metrics_serverapp[0] = res

    # -- the rounds --------------------------------------------------------------------
    def _rounds(
        self,
        coordinator: Coordinator,
        driver: AttemptDriver,
        result: LensembleResult,
        num_rounds: int,
    ) -> None:
        """Round after round until ``num_rounds`` are closed (the round number is the
        coordinator's, Flower's: round r takes θ_{r-1} to θ_r)."""
        strategy = self._strategy
        transport = strategy._transport
        assert transport is not None
        while (r := coordinator.global_state().next_round) <= num_rounds:
            say(INFO, "")
            say(INFO, "[ROUND %s/%s]", r, num_rounds)
            try:
                outcomes, metrics = self._train_round(coordinator, driver, r, num_rounds)
            finally:  # (evaluation's instructions): grace is spent
                transport.message_ttl = instruction_ttl(coordinator.core.deadlines.next())
            result.outcomes.extend(outcomes)
            aborted = [o.reason or "" for o in outcomes if o.state is RoundState.ABORTED]
            if aborted:
                result.aborted[r] = aborted
            result.arrays = self._arrays
            not_opened = self._evaluate_round(coordinator, driver, r, num_rounds, metrics, result)
            evaluation = result.evaluate_metrics_clientapp.get(r)
            server = result.evaluate_metrics_serverapp.get(r)
            reporting.report(
                outcomes[-1], metrics, evaluation, aborted, strategy._on_round, server=server
            )
            strategy._keep_metrics(r, metrics, evaluation, server)
            transport.traffic.forget_through(r)  # reported: its bookkeeping is no longer needed
            if not_opened is not None:
                raise not_opened

    def _evaluate_round(
        self,
        coordinator: Coordinator,
        driver: AttemptDriver,
        r: int,
        num_rounds: int,
        metrics: MetricRecord,
        result: LensembleResult,
    ) -> Exception | None:
        """Round ``r``'s metrics into ``result``, its federated evaluation and the
        ``evaluate_fn``'s, in FedAvg's order and with its lines. With none of them to
        wait for, the next round opens first (an error opening it is returned, to be
        raised once this round is reported)."""
        strategy = self._strategy
        messages = list(
            strategy.configure_evaluate(r, self._arrays, self._evaluate_config, self._grid)
        )
        not_opened, self._not_opened = self._not_opened, None
        if self._opened_on_close or (r < num_rounds and not messages and self._opens_ahead()):
            # Only lensemble's own bookkeeping comes between the rounds: the next round's
            # instructions go out now (or went out as this round closed), and this
            # round's lines are written while it trains
            evaluation = strategy.aggregate_evaluate(r, [])
            if not self._opened_on_close:
                try:
                    self._open_attempt(coordinator, driver, r + 1, ahead=True)
                except Exception as exc:
                    not_opened = exc
            self._opened_on_close = False
            self._say_train_metrics(r, metrics, result)
        else:
            self._say_train_metrics(r, metrics, result)
            transport = strategy._transport
            assert transport is not None
            replies = transport.request_messages(messages, timeout_s=self._timeout)
            evaluation = strategy.aggregate_evaluate(r, replies)
        if evaluation is not None:
            result.evaluate_metrics_clientapp[r] = evaluation
            say(INFO, "\t└──> Aggregated evaluation MetricRecord: %s", evaluation)
        if self._evaluate_fn is not None:  # in FedAvg's order, with its lines
            say(INFO, "Global evaluation")
            res = self._evaluate_fn(r, self._arrays)
            say(INFO, "\t└──> MetricRecord: %s", res)
            if res is not None:
                result.evaluate_metrics_serverapp[r] = res
        return not_opened

    @staticmethod
    def _say_train_metrics(r: int, metrics: MetricRecord, result: LensembleResult) -> None:
        result.train_metrics_clientapp[r] = metrics
        say(INFO, "\t└──> Aggregated MetricRecord: %s", metrics)

    def _opens_ahead(self) -> bool:
        """Whether the next round's instructions may go out before this round is
        reported: only when no code of the user's runs in between (no ``evaluate_fn``, no
        federated evaluation, no ``on_round``, Flower's own train metrics aggregation).
        Instructions nobody pulls while slow user code runs could outlive their TTL,
        and a SuperLink drops an expired instruction with its reply."""
        strategy = self._strategy
        return (
            self._evaluate_fn is None
            and strategy._on_round is None
            and strategy._train_metrics_aggr_fn is aggregate_metricrecords
        )

    def _opens_on_close(self, r: int, num_rounds: int) -> bool:
        """Whether round ``r + 1`` may open as soon as round ``r`` closes, within
        ``aggregate_train``, before the round's metrics and returned arrays are made:
        when it would open ahead anyway (:meth:`_opens_ahead`, no federated
        evaluation) and the round hooks are lensemble's own, so that no code of the
        user's can tell that ``configure_train`` ran before the default hooks finished."""
        from lensemble_flwr.strategies.lensemble import LensembleStrategy  # imports this

        strategy = self._strategy
        hooks = ("configure_train", "aggregate_train", "configure_evaluate", "aggregate_evaluate")
        return (
            r < num_rounds
            and self._opens_ahead()
            and not (strategy._fraction_evaluate > 0 and metrics_released(strategy._config))
            and all(
                getattr(type(strategy), hook) is getattr(LensembleStrategy, hook)
                for hook in hooks
            )
        )

    def _open_on_close(
        self, coordinator: Coordinator, driver: AttemptDriver, r: int
    ) -> Callable[[RoundOutcome], None]:
        """What the driver calls once round ``r`` closed: round ``r + 1`` opens (with
        the TTL of every round but the first); an error is raised once ``r`` is reported."""

        def open_next(closed: RoundOutcome) -> None:
            self._closed = closed
            transport = self._strategy._transport
            assert transport is not None
            # grace is spent
            transport.message_ttl = instruction_ttl(coordinator.core.deadlines.next())
            self._opened_on_close = True
            try:
                self._open_attempt(coordinator, driver, r + 1, ahead=True)
            except Exception as exc:
                self._not_opened = exc

        return open_next

    def _train_round(
        self, coordinator: Coordinator, driver: AttemptDriver, r: int, num_rounds: int
    ) -> tuple[list[RoundOutcome], MetricRecord]:
        """Round ``r``'s attempts until one closes. Raises what stops the federation."""
        strategy = self._strategy
        outcomes: list[RoundOutcome] = []
        while True:
            if not self._opened_ahead:
                self._open_attempt(coordinator, driver, r, ahead=False)
            self._opened_ahead = False
            driver.collect()
            self._closed = None
            if self._opens_on_close(r, num_rounds):
                driver.on_closed = self._open_on_close(coordinator, driver, r)
            try:
                returned, metrics = strategy.aggregate_train(r, driver.take_replies())
            finally:
                driver.on_closed = None
            outcome = self._closed if self._closed is not None else driver.outcome
            if outcome is None:  # an override that did not call the default ended nothing
                log.warning(
                    "round %d: aggregate_train did not call LensembleStrategy."
                    "aggregate_train; lensemble ends the attempt over what it admitted",
                    r,
                )
                outcome = driver.conclude()
                ours = strategy._after_attempt(r, coordinator, outcome, looping=True)
                returned = ours[0] if returned is None else returned
                metrics = ours[1] if metrics is None else metrics
            outcomes.append(outcome)
            self._expired.say(outcome.round, outcome.attempt)  # one line, if any
            if outcome.state is RoundState.CLOSED:
                if returned is not None:
                    self._arrays = returned
                return outcomes, metrics if metrics is not None else MetricRecord()
            assert outcome.error is not None
            if not coordinator.retry_allowed(outcome):
                log.error("round %d: federation stops: %s", outcome.round, outcome.reason)
                raise outcome.error
            log.info("round %d: retrying after %s", outcome.round, outcome.reason)
            driver.wait_for_joins()

    def _config_for(self, r: int) -> ConfigRecord:
        """The train config an attempt of round ``r`` hands ``configure_train``: a copy of
        the config as the round's first attempt found it. A retry starts from that copy
        again, so an override that changes the config in place (advanced-pytorch halves
        its learning rate at a round) changes it once per round, as in Flower's loop,
        where a round has one attempt; what the closing attempt changed carries on."""
        if self._round_config is None or self._round_config[0] != r:
            self._round_config = (r, copy.deepcopy(self._train_config))
        self._train_config = copy.deepcopy(self._round_config[1])
        return self._train_config

    def _open_attempt(
        self, coordinator: Coordinator, driver: AttemptDriver, r: int, *, ahead: bool
    ) -> None:
        """``configure_train``, and its instructions out. An error once the attempt
        began ends it ABORTED (its outcome is the attempt's); one that is not a round's
        (a SuperLink out of reach) is raised after that."""
        strategy, before = self._strategy, coordinator.attempt
        try:
            noise_multiplier_of(strategy._config, rounds=r)
            messages = strategy.configure_train(r, self._arrays, self._config_for(r), self._grid)
            attempt = coordinator.attempt
            if attempt is None or attempt is before:
                raise RuntimeError(
                    "configure_train began no round attempt (an override must call "
                    "super().configure_train, which begins it)"
                )
            driver.push(messages, attempt)
        except Exception as exc:
            attempt = coordinator.attempt
            if attempt is None or attempt is before or attempt.phase in TERMINAL_STATES:
                raise  # nothing began, or what began has ended
            driver.take_over(attempt)
            if isinstance(exc, LensembleError):
                driver.abort(exc)
            else:
                driver.abort(
                    FaultToleranceExceeded(
                        f"its RoundOpens could not be sent: {type(exc).__name__}: {exc}"
                    )
                )
                raise
        self._opened_ahead = ahead

    def _check_final_arrays(self, coordinator: Coordinator, result: LensembleResult) -> None:
        """Say so when ``result.arrays`` (what the last ``aggregate_train`` returned) is
        not the last committed model: no round trained from it, so no ledger has it."""
        strategy = self._strategy
        committed = coordinator.global_state().round
        arrays = result.arrays
        if committed == 0 or arrays is strategy._returned:
            return
        model = strategy._user_arrays(coordinator.global_state().params)
        if list(arrays) != list(model) or any(
            not np.array_equal(arrays[n].numpy(), model[n].numpy()) for n in arrays
        ):
            log.warning(
                "result.arrays is the model the last round's aggregate_train returned, which "
                "differs from round %d's committed checkpoint: no round trained from it, so "
                "the ledger records the committed model, not this one",
                committed,
            )
