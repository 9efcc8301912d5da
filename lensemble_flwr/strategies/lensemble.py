"""LensembleStrategy: the coordinator as a drop-in Flower (Message API) Strategy.

Replace ``FedAvg(...)`` with ``LensembleStrategy(config)`` and call ``start`` as before::

    strategy = LensembleStrategy(LensembleConfig.from_run_config(context.run_config))
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(...), num_rounds=10)

``start`` (:mod:`.round_loop`) calls the strategy's own ``configure_train``,
``aggregate_train``, ``configure_evaluate`` and ``aggregate_evaluate`` every round, as
Flower's ``Strategy.start`` does, so a subclass's overrides run; around them it drives
the package's Coordinator over a :class:`GridTransport`: the same state machine, quorum,
deadlines, elastic completion, exact sum, unmask exchange, outer step, checkpoints and
ledger as in-process. The hooks also work in Flower's own loop (plaintext rounds only:
a masked round's unmask exchange needs :meth:`LensembleStrategy.start`).

Everything the strategy keeps is private: a subclass may have attributes of its own
named ``run_dir``, ``config`` or ``coordinator`` (Flower's examples do), and lensemble's
run still goes where the constructor said. The read-only views of the same names give
lensemble's values to code that does not shadow them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from logging import INFO
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.app.constants import DEFAULT_TTL
from flwr.common import log as say
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from lensemble_flwr.config import LensembleConfig, metrics_released
from lensemble_flwr.coordinator.attempt import RoundOutcome
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.errors import ConfigError, FaultToleranceExceeded, LensembleError
from lensemble_flwr.gauge.runtime import GaugeSetup
from lensemble_flwr.protocol.round import TERMINAL_STATES, RoundState
from lensemble_flwr.provenance.ledger import RunManifest
from lensemble_flwr.strategies import records, reporting
from lensemble_flwr.strategies.arguments import check_arguments, with_sampling
from lensemble_flwr.strategies.attempt_driver import AttemptDriver
from lensemble_flwr.strategies.evaluation import (
    evaluate_content,
    evaluation_sample,
    usable_evaluations,
)
from lensemble_flwr.strategies.grid_transport import GridTransport, is_simulation_grid
from lensemble_flwr.strategies.layout import ArrayLayout
from lensemble_flwr.strategies.model_changes import ModelChanges
from lensemble_flwr.strategies.node_names import NodeNames
from lensemble_flwr.strategies.reporting import (
    LensembleResult,
    MetricsAggregation,
    aggregated,
)
from lensemble_flwr.strategies.run_dir import RunPlace
from lensemble_flwr.strategies.views import FedAvgAttributes, ReadOnly

__all__ = ["LensembleResult", "LensembleStrategy", "with_sampling"]

log = logging.getLogger(__name__)


class LensembleStrategy(FedAvgAttributes, Strategy):
    """A Flower Strategy whose rounds are lensemble rounds.

    Args:
        config: the federation's config (defaults to ``LensembleConfig()``).
        run_dir: where checkpoints, the ledger and the manifest go (a fresh temporary
            directory if omitted; ``result.run_dir`` says where). A relative path is
            taken from the ServerApp process's working directory when the strategy is
            made (under ``flwr run``, the folder the SuperLink was started from, not
            the app's); the log and ``result.run_dir`` show it absolute.
        run_id: names the run in every message (default ``flwr-<Flower run id>``).
        warmup_timeout: seconds ``start`` waits, before round 1, for K nodes to connect
            (nothing is sent to them); what it did not use is the first round's grace on
            its deadlines (Ray actors and SuperNode processes start on their first
            message; round deadlines should not pay for that).
        fraction_train, min_train_nodes, min_available_nodes: FedAvg's sampling: each
            round attempt invites ``max(int(N * fraction_train), min_train_nodes, K)`` of
            the N reachable nodes once ``min_available_nodes`` are reachable, drawn from a
            seed of the round (None: the config's ``sample-fraction``, ``sample-min`` and
            ``min-available``; a value given here replaces the config's, and the run
            manifest records it). :meth:`start`'s warm-up waits for
            ``min_available_nodes`` and ``min_train_nodes`` nodes whether rounds are
            sampled or not, as FedAvg does before it samples; fewer than that after it
            is a ConfigError (FedAvg would wait for ever).
        fraction_evaluate, min_evaluate_nodes: the share (0: none) and the fewest of the
            nodes asked to evaluate after each round, drawn from a seed of the round.
        arrayrecord_key, configrecord_key: the names of an instruction's ArrayRecord
            and ConfigRecord (FedAvg's; what a stock ClientApp reads).
        poll_interval: seconds between pulls of the Grid.
        on_round: called with a one-line report after every round (in Flower's own
            loop, after every attempt).
        gauge: the model's gauge adapter and pinned probe (probe announcement, frame
            drift, and ``gauge-align``).
        identities: allow-list of participant id → OpenSSH identity key (a node's id is
            its ``partition-id-<n>`` / ``lensemble-id-<x>`` node config, or ``key-<its key
            fingerprint>``, else ``node-<Flower node id>``: ``clients.app.participant_name``).
        resume: continue the run already in ``run_dir`` (after a ServerApp restart)
            instead of refusing a non-empty run directory.
        weighted_by_key: the client metric that weights the average of the clients'
            metrics, and holds a stock reply's example count (as FedAvg's); whether
            updates are weighted by it is ``weighting``'s choice.
        train_metrics_aggr_fn, evaluate_metrics_aggr_fn: ``(replies' contents,
            weighted_by_key) -> MetricRecord``, as FedAvg's (default: the weighted mean of
            every numeric metric, Flower's ``aggregate_metricrecords``).
        durable_writes: fsync every write to the run directory, so that what was
            committed survives a power loss (True), or only a killed process (False:
            writes are still published whole or not at all). None (the default): True on
            a deployment, False on Flower's simulation engine, whose participants' state
            lives in the engine's memory and cannot outlive the machine anyway.

    ``result.train_metrics_clientapp[r]`` holds the contributors' own metrics aggregated
    so, plus lensemble's bookkeeping under ``lensemble.`` (``lensemble.C_t``,
    ``lensemble.attempts``, ``lensemble.exchanges``, ``lensemble.bytes-sent``, ...).

    Set these through the constructor: the strategy keeps them privately, so that a
    subclass's attributes of the same names (Flower's examples set ``self.run_dir``)
    never redirect the run. ``run_dir``, ``config``, ``coordinator``, ``transport``,
    ``poll_interval`` and ``warmup_timeout`` read lensemble's values (unless a subclass
    shadows them with its own); ``result.run_dir`` always says where the run went.
    """

    config = ReadOnly(
        lambda s: s._config, "The federation's config (sampling arguments folded in)."
    )
    run_dir = ReadOnly(
        lambda s: s._place.path,
        "Where the run's checkpoints, ledger and manifest go (None until a run without "
        "``run_dir`` made its temporary one); ``result.run_dir`` says it too.",
    )
    coordinator = ReadOnly(
        lambda s: s._place.coordinator, "The run's Coordinator (None before a run opened)."
    )
    transport = ReadOnly(
        lambda s: s._transport, "The GridTransport of the run (None before a run opened)."
    )
    poll_interval = ReadOnly(lambda s: s._poll_interval, "Seconds between pulls of the Grid.")
    warmup_timeout = ReadOnly(
        lambda s: s._warmup_timeout, "Seconds ``start`` waits for nodes before round 1."
    )

    def __init__(
        self,
        config: LensembleConfig | None = None,
        *,
        run_dir: str | Path | None = None,
        run_id: str | None = None,
        warmup_timeout: float = 120.0,
        fraction_train: float | None = None,
        min_train_nodes: int | None = None,
        min_available_nodes: int | None = None,
        fraction_evaluate: float = 1.0,
        min_evaluate_nodes: int = 0,
        arrayrecord_key: str = records.ARRAYS,
        configrecord_key: str = records.CONFIG,
        poll_interval: float = 0.05,
        on_round: Callable[[str], None] | None = None,
        gauge: GaugeSetup | None = None,
        identities: Mapping[str, str] | None = None,
        resume: bool = False,
        weighted_by_key: str = "num-examples",
        train_metrics_aggr_fn: MetricsAggregation | None = None,
        evaluate_metrics_aggr_fn: MetricsAggregation | None = None,
        durable_writes: bool | None = None,
    ) -> None:
        keys = {"arrayrecord_key": arrayrecord_key, "configrecord_key": configrecord_key}
        callbacks = {"train_metrics_aggr_fn": train_metrics_aggr_fn, "on_round": on_round}
        check_arguments(
            config,
            identities,
            seconds={"poll_interval": poll_interval, "warmup_timeout": warmup_timeout},
            keys={"weighted_by_key": weighted_by_key, **keys},
            callbacks={**callbacks, "evaluate_metrics_aggr_fn": evaluate_metrics_aggr_fn},
            evaluation=(fraction_evaluate, min_evaluate_nodes),
        )
        self._config = with_sampling(
            config or LensembleConfig(),
            sample_fraction=fraction_train,
            sample_min=min_train_nodes,
            min_available=min_available_nodes,
        )
        self._fraction_evaluate, self._min_evaluate_nodes = fraction_evaluate, min_evaluate_nodes
        self._arrayrecord_key, self._configrecord_key = arrayrecord_key, configrecord_key
        self._gauge, self._identities = gauge, identities
        self._resume, self._durable_writes = resume, durable_writes
        self._place = RunPlace(Path(run_dir).absolute() if run_dir else None)
        self._run_id, self._on_round, self._weighted_by_key = run_id, on_round, weighted_by_key
        self._warmup_timeout, self._poll_interval = warmup_timeout, poll_interval
        self._train_metrics_aggr_fn = train_metrics_aggr_fn or aggregate_metricrecords
        self._evaluate_metrics_aggr_fn = evaluate_metrics_aggr_fn or aggregate_metricrecords
        self._transport: GridTransport | None = None
        self._layout: ArrayLayout | None = None
        self._names = NodeNames()  # which Flower node is which participant
        self._driver: AttemptDriver | None = None  # while start runs: its attempts' driver
        self._returned: ArrayRecord | None = None  # what aggregate_train last handed out
        self._round_outcomes: list[RoundOutcome] = []  # the current round's attempts so far
        # Flower round -> (the round it committed, its train metrics), from aggregate_train
        # in Flower's own loop until aggregate_evaluate writes the line with the evaluation
        self._train_reported: dict[int, tuple[int, MetricRecord]] = {}
        self._said_no_evaluation, self._changes = False, ModelChanges()

    # -- Strategy's abstract surface ---------------------------------------------------
    def summary(self) -> None:
        """Log the federation's settings (through Flower's logger, as FedAvg's summary)."""
        reporting.log_summary(self._config)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Begin the coordinator's next round attempt: its RoundOpen for every node.

        ``config`` rides on every instruction (as FedAvg's), and on those to the nodes
        invited later in the attempt. ``arrays`` other than what ``aggregate_train``
        returned (a wrapper's noise, an override's step) are adopted as the model the
        round trains from, recorded as its external step.

        Raises:
            ConfigError: in Flower's own loop (not :meth:`start`), masked rounds, which
                need an unmask exchange within the attempt that Flower's loop cannot
                make; or ``resume=True``: only :meth:`start` resumes a run.
        """
        if self._driver is None:
            _refuse_in_flowers_loop(self._config, self._resume, self._place.coordinator)
        coordinator = self._coordinator_for(grid, arrays)
        self._adopt_changes(server_round, arrays)
        attempt = coordinator.attempt
        if attempt is not None and attempt.phase not in TERMINAL_STATES:
            # the attempt never got its replies (aggregate_train was skipped, or failed
            # before it could end it): it ends here, and a new attempt asks everyone again
            coordinator.abort(
                FaultToleranceExceeded(
                    f"round {attempt.round} attempt {attempt.number}: configure_train was "
                    "called again before aggregate_train had the attempt's replies"
                )
            )
        attempt = coordinator.begin_attempt()
        transport = self._transport
        assert transport is not None  # made with the coordinator
        transport.open_attempt(config, attempt.deadlines, attempt.grace)
        for peer, round_open in coordinator.invite(transport.peers(fresh=True)):
            transport.send(peer, round_open)
        return transport.take_queued()

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """End the attempt that :meth:`configure_train` began, over its ``replies``.

        In :meth:`start`, each reply was admitted as it arrived (validated, hashed): the
        round concludes over what was admitted, whatever ``replies`` holds; a reply left
        out of them is logged as such, and is in the round all the same. In Flower's own
        loop the replies are admitted here. The error table and ``max-round-attempts``
        apply: an attempt that may be retried returns no arrays, one that may not raises.

        Raises:
            LensembleError: the attempt aborted with an error that stops the federation,
                or the round used up its attempts.
        """
        coordinator = self._place.coordinator
        attempt = coordinator.attempt if coordinator is not None else None
        driver = self._driver
        fed_already = driver is not None and driver.drives(attempt)
        if coordinator is None or attempt is None or (
            attempt.phase in TERMINAL_STATES and not fed_already
        ):
            raise RuntimeError(
                "aggregate_train without a round begun by configure_train (an override of "
                "configure_train must call super().configure_train, which begins it)"
            )
        transport = self._transport
        assert transport is not None
        replies = list(replies)
        reporting.say_received("aggregate_train", replies)
        if driver is not None and fed_already:
            _say_left_out(attempt.round, driver.reply_ids, replies)
            outcome = driver.conclude()
        else:
            payloads, peers = transport.payloads_of(replies, attempt.round_open)
            outcome = coordinator.conclude_collected(payloads, peers)
        return self._after_attempt(server_round, coordinator, outcome, looping=fed_already)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Evaluate instructions (global arrays + config) for a share of the nodes."""
        if self._fraction_evaluate <= 0:  # nobody is asked: the Grid need not list the nodes
            return []
        nodes = sorted(grid.get_node_ids())
        if not nodes or not self._evaluates():
            return []
        chosen = evaluation_sample(
            server_round,
            [self._names.name_of(n) for n in nodes],
            self._fraction_evaluate,
            self._min_evaluate_nodes,
            self._config.federation.root_seed,
        )
        close = self._transport.round_close if self._transport is not None else None
        content = evaluate_content(
            server_round,
            arrays,
            config,
            close,
            arrays_key=self._arrayrecord_key,
            config_key=self._configrecord_key,
        )
        return [
            Message(
                content=content,
                dst_node_id=self._names.node_of(peer),
                message_type=MessageType.EVALUATE,
            )
            for peer in chosen
        ]

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Aggregate the replies' metrics with ``evaluate_metrics_aggr_fn`` (default: the
        mean weighted by ``weighted_by_key``, as FedAvg does)."""
        replies = list(replies)
        reporting.say_received("aggregate_evaluate", replies)
        contents = usable_evaluations(
            server_round, replies, self._names.name_of, self._weighted_by_key
        )
        aggr, key = self._evaluate_metrics_aggr_fn, self._weighted_by_key
        evaluation = aggregated(aggr, contents, key, "evaluation") if contents else None
        # in Flower's own loop, the round aggregate_train reported gets its full line
        # (start writes its lines itself, once the round is evaluated)
        reported = self._train_reported.pop(server_round, None)
        if reported is not None and evaluation is not None:
            self._keep_metrics(reported[0], reported[1], evaluation)
        return evaluation

    # -- the round loop ----------------------------------------------------------------
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> LensembleResult:
        """Run lensemble rounds over ``grid`` until ``num_rounds`` rounds are closed (a
        resumed run counts the rounds it closed before the restart).

        Every round calls this strategy's ``configure_train``, ``aggregate_train``,
        ``configure_evaluate`` and ``aggregate_evaluate``, as Flower's loop does (see
        :mod:`.round_loop` for what happens around them). ``timeout`` bounds each
        evaluation exchange; training rounds use the config's open and collect timeouts.
        A round whose attempts abort is retried as configured (a retry is the same
        round: ``server_round`` does not move on); an error that stops the federation is
        raised (the result so far is in the run dir). lensemble's own warnings show as
        Flower's lines do, unless logging is configured (:mod:`.flower_logs`).

        Raises:
            StoreError: the run directory already holds a run (without ``resume``).
            ConfigError: too few nodes for a round, or a DP plan that does not fit
                ``num_rounds``; nothing is sent.
        """
        from lensemble_flwr.strategies.round_loop import RoundLoop  # it imports this module

        loop = RoundLoop(self, grid, timeout, train_config, evaluate_config, evaluate_fn)
        return loop.run(initial_arrays, num_rounds)

    def writes_durably(self, grid: Grid) -> bool:
        """Whether the run directory's writes are fsynced on ``grid`` (``durable_writes``;
        by default, everywhere but on the simulation engine)."""
        if self._durable_writes is not None:
            return self._durable_writes
        return not is_simulation_grid(grid)

    # -- what start and Flower's own loop share -----------------------------------------
    def _open_run(self, grid: Grid, arrays: ArrayRecord, transport: GridTransport) -> Coordinator:
        """A new run (or the resumed one) over ``transport``, in the run directory."""
        self._transport, self._returned = transport, None
        self._round_outcomes, self._train_reported = [], {}
        run_id = self._run_id or f"flwr-{_flower_run_id(grid)}"
        coordinator = self._place.open(
            self._config,
            arrays,
            run_id=run_id,
            sync=self.writes_durably(grid),
            transport=transport,
            gauge=self._gauge,
            identities=self._identities,
            resume=self._resume,
        )
        transport.on_rename = coordinator.rename
        transport.proves_name = coordinator.proves_name  # a name binds only if signed for
        transport.allowed = set(self._identities) if self._identities is not None else None
        transport.weight_key = self._weighted_by_key
        return coordinator

    def _new_transport(self, grid: Grid, arrays: ArrayRecord, message_ttl: float) -> GridTransport:
        return GridTransport(
            grid,
            message_ttl=message_ttl,
            layout=self._layout_of(arrays),
            arrays_key=self._arrayrecord_key,
            config_key=self._configrecord_key,
            names=self._names,
            poll_interval=self._poll_interval,
        )

    def _coordinator_for(self, grid: Grid, arrays: ArrayRecord) -> Coordinator:
        """The run's coordinator; in Flower's own loop, the first call opens the run
        (its instructions keep Flower's default TTL, as FedAvg's do)."""
        coordinator = self._place.coordinator
        if coordinator is None or self._transport is None:
            return self._open_run(grid, arrays, self._new_transport(grid, arrays, DEFAULT_TTL))
        return coordinator

    def _after_attempt(
        self, server_round: int, coordinator: Coordinator, outcome: RoundOutcome, *, looping: bool
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """What ``aggregate_train`` returns for an attempt that ended with ``outcome``;
        in Flower's own loop, the attempt's report line too (start reports a round
        once it is evaluated)."""
        if self._round_outcomes and self._round_outcomes[-1].round != outcome.round:
            self._round_outcomes = []
        self._round_outcomes.append(outcome)
        transport = self._transport
        assert transport is not None
        metrics = reporting.round_metrics(
            outcome,
            transport.traffic,
            attempts=len(self._round_outcomes),
            exchanges=looping,  # Flower's own loop moves the messages: it counts none
            weighted_by_key=self._weighted_by_key,
            aggregate=self._train_metrics_aggr_fn, epsilon=_spent_epsilon(coordinator, outcome),
        )
        closed = outcome.state is RoundState.CLOSED
        if not looping:
            aborted = [
                o.reason or "" for o in self._round_outcomes if o.state is RoundState.ABORTED
            ]
            reporting.report(outcome, metrics, None, aborted, self._on_round)
            if closed:  # its line now, and again with the evaluation's metrics
                self._keep_metrics(outcome.round, metrics, None)
                self._train_reported[server_round] = (outcome.round, metrics)
                transport.traffic.forget_through(outcome.round)
        if closed:
            self._returned = self._user_arrays(coordinator.global_state().params)
            return self._returned, metrics
        assert outcome.error is not None
        if coordinator.retry_allowed(outcome):
            if not looping:
                log.info("round %d: retried next Flower round: %s", outcome.round, outcome.reason)
            return None, metrics
        log.error("round %d: federation stops: %s", outcome.round, outcome.reason)
        raise outcome.error

    def _adopt_changes(self, server_round: int, arrays: ArrayRecord) -> None:
        """Train from ``arrays`` when something changed what ``aggregate_train`` returned
        (:mod:`.model_changes`)."""
        returned, coordinator = self._returned, self._place.coordinator
        if returned is None or arrays is returned or coordinator is None:
            return
        layout = self._layout_of(arrays)
        if self._changes.adopt(coordinator, layout, returned, arrays, server_round):
            self._returned = arrays

    def _evaluates(self) -> bool:
        """Whether nodes are asked to evaluate: ``fraction_evaluate`` > 0, and not under DP
        or secure aggregation unless ``dp-release-metrics`` opts in (the participants
        refuse then: asking would cost an exchange per round, and a stock ClientApp would
        answer with un-noised per-node metrics). Said once in the log."""
        if self._fraction_evaluate <= 0:
            return False
        if metrics_released(self._config):
            return True
        if not self._said_no_evaluation:
            self._said_no_evaluation = True
            say(  # in Flower's stream, with the round lines
                INFO, "no federated evaluation: under DP or secure aggregation the participants "
                "release no per-node metrics (set dp-release-metrics = true to ask, on "
                "nodes whose node config allows it: dp-release-metrics=true)"
            )
        return False

    def _layout_of(self, arrays: ArrayRecord) -> ArrayLayout:
        """The user's array layout, taken from the first arrays the strategy is given."""
        if self._layout is None:
            self._layout = ArrayLayout.split(arrays)[0]
        return self._layout

    def _user_arrays(self, params: Mapping[str, Any]) -> ArrayRecord:
        """The global params as the user's ArrayRecord: their names in their order, the
        carried arrays as given."""
        if self._layout is None:
            return records.arrays_to_record(params)
        return self._layout.to_record(params)

    def _keep_metrics(
        self,
        server_round: int,
        metrics: MetricRecord,
        evaluation: MetricRecord | None,
        server: MetricRecord | None = None,
    ) -> None:
        coordinator = self._place.coordinator
        durable = coordinator is None or coordinator.store.sync
        reporting.keep_metrics(
            self._place.path, server_round, metrics, evaluation, durable=durable, server=server
        )


def _refuse_in_flowers_loop(
    config: LensembleConfig, resume: bool, coordinator: Coordinator | None
) -> None:
    """Flower's own loop (``Strategy.start``, a wrapper's) runs no masked round and
    resumes no run: refused before anything is made or sent."""
    if config.federation.masked:
        raise ConfigError(
            "secagg-threshold",
            "masked rounds need a second exchange (unmask requests) within each "
            "attempt, which Flower's configure_train/aggregate_train loop cannot make; "
            "call LensembleStrategy.start() instead",
        )
    if coordinator is None and resume:
        raise ConfigError(
            "resume",
            "a run is resumed only by LensembleStrategy.start: Flower's stock loop "
            "(Strategy.start, and every wrapper such as the central-DP ones) restarts "
            "at round 1 from the initial arrays, and a wrapper's noise on the last "
            "committed model would be lost (the un-noised model would be sent)",
        )


def _say_left_out(round: int, came: frozenset[int], replies: list[Message]) -> None:
    """In :meth:`LensembleStrategy.start`, every reply was admitted as it arrived: say so
    when an ``aggregate_train`` override hands the default fewer replies than came."""
    given = {id(reply) for reply in replies}
    missing = sorted(came - given)
    if missing:
        log.warning(
            "round %d: aggregate_train was handed %d of the attempt's %d replies; lensemble "
            "admitted each reply as it arrived, so the round's sum and its ledger record "
            "include the %d left out (drop a node by refusing it on the node, or with "
            "the identity allow-list, not in aggregate_train)",
            round,
            len(came & given),
            len(came),
            len(missing),
        )


def _spent_epsilon(coordinator: Coordinator, outcome: RoundOutcome) -> float | None:
    """The largest cumulative ε the attempt's admitted updates claimed (its manifest
    entry's; None without DP, or when the entry cannot be read: the line goes on)."""
    if not coordinator.config.privacy.noised:
        return None
    try:
        entry = RunManifest.entry(coordinator.store, outcome.round, outcome.attempt)
    except LensembleError as exc:
        log.warning("round %d: its manifest entry could not be read: %s", outcome.round, exc)
        return None
    spent = [e for e in ((entry.epsilon or {}).values() if entry else ()) if e is not None]
    return max(spent) if spent else None


def _flower_run_id(grid: Grid) -> str:
    try:
        return str(grid.run.run_id)
    except Exception:  # a Grid without a run (tests): name the run by its object
        return f"{id(grid):x}"

