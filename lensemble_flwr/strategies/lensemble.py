"""LensembleStrategy: the coordinator as a drop-in Flower (Message API) Strategy.

Replace ``FedAvg(...)`` with ``LensembleStrategy(config)`` and call ``start`` as before::

    strategy = LensembleStrategy(LensembleConfig.from_run_config(context.run_config))
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(...), num_rounds=10)

``start`` drives the package's Coordinator over a :class:`GridTransport`: the same
state machine, quorum, deadlines, elastic completion, exact sum, outer step, checkpoints
and ledger as in-process. ``configure_train``/``aggregate_train`` also work on their own
(Flower's stock loop): ``configure_train`` begins a round attempt of the same
coordinator and ``aggregate_train`` feeds the replies into its admission step (plaintext
rounds only: masked rounds need :meth:`LensembleStrategy.start`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import numbers
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log as say
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import (
    aggregate_metricrecords,
    log_strategy_start_info,
)

from lensemble_flwr.aggregation import recycling
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import derive_seed, seeded_sample
from lensemble_flwr.config import FederationConfig, LensembleConfig, metrics_released
from lensemble_flwr.coordinator.coordinator import Coordinator, RoundOutcome, holds_a_run
from lensemble_flwr.coordinator.outer_optimizer import influence_scale
from lensemble_flwr.errors import (
    ConfigError,
    FaultToleranceExceeded,
    ForgedMessage,
    ParameterMismatch,
    StoreError,
)
from lensemble_flwr.gauge.runtime import GaugeSetup
from lensemble_flwr.identity.signing import parse_public_key
from lensemble_flwr.privacy.calibration import noise_multiplier_of
from lensemble_flwr.protocol.messages import MessageKind, to_wire
from lensemble_flwr.protocol.round import TERMINAL_STATES, RoundState
from lensemble_flwr.provenance.round_metrics import (
    METRICS_NAME,
    append_round_metrics,
)
from lensemble_flwr.strategies import records
from lensemble_flwr.strategies.flower_logs import lensemble_logs_through_flower
from lensemble_flwr.strategies.grid_transport import (
    GridTransport,
    SentInstruction,
    error_refusal,
    is_simulation_grid,
    malformed_refusal,
    train_reply_payloads,
)
from lensemble_flwr.strategies.layout import ArrayLayout
from lensemble_flwr.strategies.node_names import NodeNames
from lensemble_flwr.strategies.unstarted_run import RunDirBefore

log = logging.getLogger(__name__)

MetricsAggregation = Callable[[list[RecordDict], str], MetricRecord]
"""FedAvg's ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn``: (replies' contents,
the weighting key) -> the aggregated MetricRecord."""
BOOKKEEPING = "lensemble."
"""Prefix of lensemble's own per-round metrics (C_t, attempts, exchanges, bytes, ...)."""
_FLOWER_LOOP_HOOKS = ("configure_train", "aggregate_train", "configure_evaluate")
"""The hooks Flower's ``Strategy.start`` calls every round and ``LensembleStrategy.start``'s
own loop does not (it calls ``aggregate_evaluate`` and ``summary`` itself)."""


@dataclasses.dataclass(repr=False)  # Flower's summary, not a dump of every outcome
class LensembleResult(Result):
    """Flower's Result, plus what a MetricRecord cannot hold: why attempts aborted."""

    aborted: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    outcomes: list[RoundOutcome] = dataclasses.field(default_factory=list)
    run_dir: Path | None = None

    def __repr__(self) -> str:
        """Flower's summary of a Result, then the run directory and the aborted attempts."""
        aborted = sum(len(reasons) for reasons in self.aborted.values())
        return (
            super().__repr__()
            + f"\nRun directory (checkpoints, ledger, manifest): {self.run_dir}\n"
            + f"Aborted attempts: {aborted}"
            + "".join(f"\n\tround {r}: {'; '.join(why)}" for r, why in sorted(self.aborted.items()))
            + "\n"
        )


class LensembleStrategy(Strategy):
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
        on_round: called with a one-line report after every round attempt.
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
    """

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
        _check_arguments(
            config,
            identities,
            seconds={"poll_interval": poll_interval, "warmup_timeout": warmup_timeout},
            keys={
                "weighted_by_key": weighted_by_key,
                "arrayrecord_key": arrayrecord_key,
                "configrecord_key": configrecord_key,
            },
            callbacks={
                "on_round": on_round,
                "train_metrics_aggr_fn": train_metrics_aggr_fn,
                "evaluate_metrics_aggr_fn": evaluate_metrics_aggr_fn,
            },
        )
        self.config = with_sampling(
            config or LensembleConfig(),
            sample_fraction=fraction_train,
            sample_min=min_train_nodes,
            min_available=min_available_nodes,
        )
        if not 0 <= fraction_evaluate <= 1 or min_evaluate_nodes < 0:
            raise ConfigError(
                "fraction_evaluate",
                f"must be in [0, 1] with min_evaluate_nodes >= 0, got {fraction_evaluate} "
                f"and {min_evaluate_nodes}",
            )
        self.min_evaluate_nodes = min_evaluate_nodes
        self.arrayrecord_key, self.configrecord_key = arrayrecord_key, configrecord_key
        self.gauge = gauge
        self.identities = identities
        self.resume = resume
        self.durable_writes = durable_writes
        self.run_dir = Path(run_dir).absolute() if run_dir else None
        self.run_id = run_id
        self.warmup_timeout = warmup_timeout
        self.fraction_evaluate = fraction_evaluate
        self.poll_interval = poll_interval
        self.on_round = on_round
        self.weighted_by_key = weighted_by_key
        self.train_metrics_aggr_fn = train_metrics_aggr_fn or aggregate_metricrecords
        self.evaluate_metrics_aggr_fn = evaluate_metrics_aggr_fn or aggregate_metricrecords
        self.coordinator: Coordinator | None = None
        self.transport: GridTransport | None = None
        self.layout: ArrayLayout | None = None
        self.names = NodeNames()  # which Flower node is which participant
        self._connected: set[int] = set()  # the nodes configure_train last saw
        self._returned: ArrayRecord | None = None  # what aggregate_train last handed out
        # Flower round -> (the round it committed, its train metrics), from aggregate_train
        # until aggregate_evaluate writes the round's line with the evaluation's metrics
        self._train_reported: dict[int, tuple[int, MetricRecord]] = {}
        self._said_no_evaluation = False
        self._said_influence = False

    # -- Strategy's abstract surface ---------------------------------------------------
    def summary(self) -> None:
        """Log the federation's settings (through Flower's logger, as FedAvg's summary)."""
        fed, outer = self.config.federation, self.config.outer
        say(
            INFO,
            "\t├──> LensembleStrategy: quorum K=%d (min-participants %d, secagg-threshold "
            "%d), open %.0fs, collect %.0fs",
            fed.quorum,
            fed.min_participants,
            fed.secagg_threshold,
            fed.open_timeout,
            fed.collect_timeout,
        )
        say(
            INFO,
            "\t├── outer step: lr %.3g, momentum %.3g, nesterov %s; update weighting %s "
            "(FedAvg's: num-examples); require-binding %s",
            outer.lr,
            outer.momentum,
            outer.nesterov,
            fed.weighting,
            fed.require_binding,
        )
        reachable = max(fed.quorum, fed.min_available)  # before an attempt draws its sample
        if fed.sampled and fed.sample_mode == "poisson":
            say(
                INFO,
                "\t└── sampling: each reachable node with probability %.3g per round "
                "(Poisson; a draw below K = %d is redrawn), once %d are reachable",
                fed.sample_fraction,
                fed.quorum,
                reachable,
            )
        elif fed.sampled:
            say(
                INFO,
                "\t└── sampling: %.3g of the reachable nodes per round (at least %d), once "
                "%d are reachable",
                fed.sample_fraction,
                max(fed.sample_min, fed.quorum),
                reachable,
            )
        else:
            say(
                INFO,
                "\t└── sampling: none (every reachable node is asked every round, once %d "
                "are reachable)",
                reachable,
            )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Begin the coordinator's next round attempt: its RoundOpen for every node.

        Raises:
            ConfigError: the config asks for masked rounds, which need an unmask exchange
                within the attempt that ``configure_train``/``aggregate_train`` cannot
                make; run them with :meth:`start`. Or the strategy was made with
                ``resume=True``: only :meth:`start` resumes a run.
        """
        if self.config.federation.secagg_threshold > 0:
            raise ConfigError(
                "secagg-threshold",
                "masked rounds need a second exchange (unmask requests) within each "
                "attempt, which Flower's configure_train/aggregate_train loop cannot make; "
                "call LensembleStrategy.start() instead",
            )
        if self.coordinator is None and self.resume:
            raise ConfigError(
                "resume",
                "a run is resumed only by LensembleStrategy.start: Flower's stock loop "
                "(Strategy.start, and every wrapper such as the central-DP ones) restarts "
                "at round 1 from the initial arrays, and a wrapper's noise on the last "
                "committed model would be lost (the un-noised model would be sent)",
            )
        coordinator = self._ensure_coordinator(grid, arrays)
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
        coordinator.begin_attempt()
        self._connected = set(grid.get_node_ids())
        nodes = {self.names.name_of(node): node for node in self._connected}
        close = coordinator.last_close
        layout = self._layout_of(arrays)
        messages = []
        params_record = None
        for peer, round_open in coordinator.invite(nodes):
            if params_record is None:
                params_record = layout.to_record(round_open.params)
            content = records.encode_instruction(
                to_wire(round_open),
                server_round=server_round,
                user_config=dict(config),
                round_close=to_wire(close) if close else None,
                params_record=params_record,
                carried=layout.carried_names,
                arrays_key=self.arrayrecord_key,
                config_key=self.configrecord_key,
            )
            messages.append(
                Message(content=content, dst_node_id=nodes[peer], message_type=MessageType.TRAIN)
            )
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Finish the attempt that :meth:`configure_train` began on the collected ``replies``.

        The replies go through the same admission step as in :meth:`start`; the error
        table and ``max-round-attempts`` apply: an attempt that may be retried returns no
        arrays (the next Flower round retries it), one that may not raises its error.

        Raises:
            LensembleError: the attempt aborted with an error that stops the federation,
                or the round used up its attempts.
        """
        coordinator = self.coordinator
        attempt = coordinator.attempt if coordinator is not None else None
        if coordinator is None or attempt is None or attempt.phase in TERMINAL_STATES:
            raise RuntimeError(
                "aggregate_train without a round begun by configure_train (an override of "
                "configure_train must call super().configure_train, which begins it)"
            )
        template = attempt.round_open
        payloads, peers = [], []
        replies = list(replies)
        for reply in replies:
            peer = self._named(coordinator, reply)
            peers.append(peer)
            info = SentInstruction(
                peer=peer,
                kind=MessageKind.ROUND_OPEN,
                round=template.round,
                attempt=template.attempt,
                run_id=template.run_id,
                params=template.params,
                pushed_at=0.0,
            )
            if reply.has_error() and reply.metadata.src_node_id == SUPERLINK_NODE_ID:
                log.info("round %d: the SuperLink reports: %s", server_round, reply.error.reason)
                continue
            if reply.has_error():
                refusal = error_refusal(reply, info)
                payloads.extend([refusal] if refusal is not None else [])
                continue
            try:
                payloads.extend(
                    train_reply_payloads(
                        reply.content,
                        info,
                        peer,
                        carried=self._carried(),
                        weight_key=self.weighted_by_key,
                    )
                )
            except ValueError as exc:  # the node's answer all the same: its refusal,
                # which the coordinator logs with the reason (as on start's path)
                refusal = malformed_refusal(info, str(exc), reply.metadata.src_node_id)
                payloads.extend([refusal] if refusal is not None else [])
        outcome = coordinator.conclude_collected(payloads, peers)
        client = {
            self.names.name_of(r.metadata.src_node_id): r.content
            for r in replies
            if not r.has_error()
        }
        # counted over the round's attempts so far, as start's own loop counts them: the
        # last outcomes (a round's attempts follow each other), not a scan of the whole run
        this_round = list(
            itertools.takewhile(lambda o: o.round == outcome.round, reversed(coordinator.outcomes))
        )
        aborted = [o.reason or "" for o in this_round if o.state is RoundState.ABORTED]
        metrics = self._metrics(
            outcome,
            attempts=len(this_round),
            client_metrics=[client[p] for p in outcome.contributors if p in client],
        )
        # the attempt's line (and on_round), as start's own loop reports a round; a
        # closed round's metrics go to round-metrics.jsonl now, and again with the
        # evaluation's when aggregate_evaluate has them (a round's last line counts)
        closed = outcome.state is RoundState.CLOSED
        self._report(outcome, metrics, None, aborted)
        if closed:
            self._keep_metrics(outcome.round, metrics, None)
            self._train_reported[server_round] = (outcome.round, metrics)
            self._returned = self._user_arrays(coordinator.global_state().params)
            return self._returned, metrics
        assert outcome.error is not None
        if coordinator.retry_allowed(outcome):
            log.info("round %d: retried next Flower round: %s", outcome.round, outcome.reason)
            return None, metrics
        log.error("round %d: federation stops: %s", outcome.round, outcome.reason)
        raise outcome.error

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Evaluate instructions (global arrays + config) for a share of the nodes."""
        nodes = sorted(grid.get_node_ids())
        if not nodes or not self._evaluates():
            return []
        chosen = self._evaluation_sample(server_round, [self.names.name_of(n) for n in nodes])
        return [
            Message(
                content=self._evaluate_content(server_round, arrays, config),
                dst_node_id=self.names.node_of(peer),
                message_type=MessageType.EVALUATE,
            )
            for peer in chosen
        ]

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Aggregate the replies' metrics with ``evaluate_metrics_aggr_fn`` (default: the
        mean weighted by ``weighted_by_key``, as FedAvg does)."""
        valid: list[tuple[str, RecordDict]] = []
        left_out: list[str] = []
        for reply in replies:
            source = reply.metadata.src_node_id
            node = "the SuperLink" if source == SUPERLINK_NODE_ID else self.names.name_of(source)
            if reply.has_error():
                reason = " ".join((reply.error.reason or "no reason given").split())
                cut = reason if len(reason) <= 200 else reason[:199] + "…"
                left_out.append(f"{node} (error {reply.error.code}: {cut})")
            elif (why := _not_weighted(reply.content, self.weighted_by_key)) is not None:
                left_out.append(f"{node} ({why})")
            else:
                valid.append((node, reply.content))
        # summed in the nodes' order, not the replies' arrival order: with stable participant
        # names, two runs of the same federation report the same metrics to the last bit
        valid.sort(key=lambda named: named[0])
        if left_out:  # FedAvg would stop the run; the round is committed, so say it loudly
            more = f" and {len(left_out) - 3} more" if len(left_out) > 3 else ""
            log.warning(
                "round %d: %d evaluation repl%s left out of the aggregated metrics: %s%s",
                server_round,
                len(left_out),
                "y" if len(left_out) == 1 else "ies",
                "; ".join(left_out[:3]),
                more,
            )
        contents = [content for _, content in valid]
        evaluation = (
            _aggregated(self.evaluate_metrics_aggr_fn, contents, self.weighted_by_key, "evaluation")
            if contents
            else None
        )
        # in Flower's loop, the round aggregate_train reported gets its full line (start's
        # own loop writes its lines itself: it calls no aggregate_train)
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

        ``timeout`` bounds each evaluation exchange; training rounds use the config's open
        and collect timeouts. A round whose attempts abort is retried as configured; an
        error that stops the federation is raised (the result so far is in the run dir).
        lensemble's own warnings show as Flower's lines do, unless logging is configured
        (:mod:`.flower_logs`).

        A subclass that overrides ``configure_train``, ``aggregate_train`` or
        ``configure_evaluate`` (as Flower's examples subclass FedAvg), on its class or on
        the object, gets Flower's own round loop, ``Strategy.start``, which calls them
        every round; this method's own loop would not. See :meth:`_start_flowers_loop`
        for what that loop does differently.
        """
        with lensemble_logs_through_flower():
            hooks = self.overridden_round_hooks()
            if hooks:
                return self._start_flowers_loop(
                    hooks, grid, initial_arrays, num_rounds, timeout, train_config,
                    evaluate_config, evaluate_fn,
                )  # fmt: skip
            return self._start(
                grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config,
                evaluate_fn,
            )  # fmt: skip

    def overridden_round_hooks(self) -> list[str]:
        """The round hooks of Flower's loop that this strategy overrides, on its class or
        on the object itself (``configure_train``, ``aggregate_train``,
        ``configure_evaluate``): :meth:`start` runs Flower's loop when there is any, since
        its own loop would not call them."""
        return [
            name
            for name in _FLOWER_LOOP_HOOKS
            if name in vars(self)
            or getattr(type(self), name) is not getattr(LensembleStrategy, name)
        ]

    def _start_flowers_loop(
        self,
        hooks: list[str],
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int,
        timeout: float,
        train_config: ConfigRecord | None,
        evaluate_config: ConfigRecord | None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None,
    ) -> LensembleResult:
        """``start`` for a strategy that overrides ``hooks``: Flower's ``Strategy.start``,
        after the checks and the warm-up of lensemble's own loop.

        What Flower's loop does differently: a retried attempt takes a Flower round (the
        run may end with fewer rounds committed than ``num_rounds``: the log says how
        many), and it follows at once (no ``retry-wait``; a sampled round starts with
        the nodes connected then); each exchange, evaluation included, waits at most
        ``timeout`` or the config's open plus collect timeouts (plus what is left of the
        warm-up budget), whichever is shorter; the result's metrics are keyed by Flower
        round; each attempt's report line (and ``on_round``) comes from ``aggregate_train``,
        before the round's evaluation, so it holds no evaluation metrics (the round's line in
        ``round-metrics.jsonl`` gets them from ``aggregate_evaluate``). A
        model that ``aggregate_train`` changed is adopted as that round's external step
        when the next round trains from it; a change in the last round is in
        ``result.arrays`` only (the log says so).

        Raises:
            ConfigError: ``resume`` (Flower's loop restarts at round 1), masked rounds
                (they need an unmask exchange within the attempt), a DP plan that does
                not fit ``num_rounds``, or too few nodes for a round (as ``start``);
                nothing is sent.
            StoreError: the run directory already holds a run (a second ``start`` of
                the same object, as in ``start``'s own loop); nothing is sent.
        """
        name, listed = type(self).__name__, ", ".join(hooks)
        if self.resume:
            raise ConfigError(
                "resume",
                f"{name} overrides {listed}, which only Flower's own round loop calls, and "
                "that loop cannot resume a run (it restarts at round 1 from the initial "
                "arrays): drop resume=True, or the overrides",
            )
        fed = self.config.federation
        if fed.secagg_threshold > 0:
            raise ConfigError(
                "secagg-threshold",
                f"{name} overrides {listed}, which only Flower's own round loop calls, and "
                "masked rounds need an unmask exchange within each attempt that this loop "
                "cannot make: drop the overrides, or set secagg-threshold = 0",
            )
        noise_multiplier_of(self.config, rounds=num_rounds)  # a plan that fits
        say(
            INFO,
            "%s overrides %s: Flower's own round loop (Strategy.start) runs the rounds, "
            "so that %s called every round",
            name,
            listed,
            "it is" if len(hooks) == 1 else "they are",
        )
        # a run of its own, as start's loop makes (a second start of this object is
        # refused: its run directory holds the first run), before the warm-up
        self.coordinator, self._returned = None, None
        self._train_reported.clear()
        with self._undone_if_it_fails():  # before round 1: a failure leaves no run
            coordinator = self._ensure_coordinator(grid, initial_arrays)  # configure_train's too
            warm_up = GridTransport(grid, message_ttl=0.0, names=self.names)
            waited = self._warm_up(warm_up, 0, num_rounds)
            # Flower's loop evaluates the initial model first: here, so that an
            # evaluate_fn that raises takes the run back too; the loop gets the result
            initial = evaluate_fn(0, initial_arrays) if evaluate_fn is not None else None

        def evaluate_once_at_round_0(
            server_round: int, arrays: ArrayRecord
        ) -> MetricRecord | None:
            assert evaluate_fn is not None  # only handed to Flower's loop with one
            return initial if server_round == 0 else evaluate_fn(server_round, arrays)

        # each exchange waits at most a round's deadlines plus what is left of the warm-up
        # budget: Flower's loop has one timeout for every exchange, and the first round's
        # cold ClientApps need that grace (start's own loop gives it to the first only)
        grace = max(0.0, self.warmup_timeout - waited)
        flower = Strategy.start(
            self,
            grid=grid,
            initial_arrays=initial_arrays,
            num_rounds=num_rounds,
            timeout=min(timeout, fed.open_timeout + fed.collect_timeout + grace),
            train_config=train_config,
            evaluate_config=evaluate_config,
            evaluate_fn=evaluate_once_at_round_0 if evaluate_fn is not None else None,
        )
        outcomes = list(coordinator.outcomes)
        aborted: dict[int, list[str]] = {}
        for outcome in outcomes:
            if outcome.state is RoundState.ABORTED:
                aborted.setdefault(outcome.round, []).append(outcome.reason or "")
        committed = coordinator.global_state().round
        if committed < num_rounds:
            log.warning(
                "%d of %d rounds committed: in Flower's own loop a retried attempt takes a "
                "Flower round (%d attempt(s) aborted; result.aborted says why)",
                committed,
                num_rounds,
                sum(len(reasons) for reasons in aborted.values()),
            )
        # Flower's result holds what the last aggregate_train returned, or nothing
        arrays, model = flower.arrays, self._user_arrays(coordinator.global_state().params)
        if not len(arrays):  # no round returned a model: the run's, as start's loop gives
            arrays = model if committed > 0 else initial_arrays
        elif committed > 0 and (
            list(arrays) != list(model)
            or any(not np.array_equal(arrays[n].numpy(), model[n].numpy()) for n in arrays)
        ):
            log.warning(
                "result.arrays is the model the last round's aggregate_train returned, which "
                "differs from round %d's committed checkpoint: no round trained from it, so "
                "the ledger records the committed model, not this one",
                committed,
            )
        return LensembleResult(
            arrays=arrays,
            train_metrics_clientapp=flower.train_metrics_clientapp,
            evaluate_metrics_clientapp=flower.evaluate_metrics_clientapp,
            evaluate_metrics_serverapp=flower.evaluate_metrics_serverapp,
            aborted=aborted,
            outcomes=outcomes,
            run_dir=self.run_dir,
        )

    def _start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int,
        timeout: float,
        train_config: ConfigRecord | None,
        evaluate_config: ConfigRecord | None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None,
    ) -> LensembleResult:
        noise_multiplier_of(self.config, rounds=num_rounds)  # a plan that fits
        say(INFO, "Starting %s strategy:", type(self).__name__)
        log_strategy_start_info(num_rounds, initial_arrays, train_config, evaluate_config)
        self.summary()
        say(INFO, "")
        t_start = time.time()
        fed = self.config.federation
        transport = GridTransport(
            grid,
            message_ttl=fed.open_timeout + fed.collect_timeout,
            user_config=dict(train_config or {}),
            layout=self._layout_of(initial_arrays),
            arrays_key=self.arrayrecord_key,
            config_key=self.configrecord_key,
            names=self.names,
            poll_interval=self.poll_interval,
        )
        self.transport = transport
        with self._undone_if_it_fails():  # before round 1: a failure leaves no run
            coordinator = self._ensure_coordinator(grid, initial_arrays, transport=transport)
            transport.on_rename = coordinator.rename
            transport.allowed = set(self.identities) if self.identities is not None else None
            transport.weight_key = self.weighted_by_key
            result = LensembleResult(arrays=initial_arrays, run_dir=self.run_dir)
            done = coordinator.global_state().round
            waited = self._warm_up(transport, done, num_rounds)
            # Connected is not started: Ray actors and SuperNode ClientApp processes start on
            # their first message. The first round's deadlines get the rest of the warm-up
            # budget as grace; a round in which every invited node answered ends at once, so
            # the grace only delays a first round that a node leaves unanswered.
            grace = max(0.0, self.warmup_timeout - waited)
            coordinator.grant_grace(grace)
            # the first instructions may wait in the SuperLink as long as their round's
            # deadlines with the grace: an instruction that expired before a cold ClientApp
            # picked it up would lose the node the round (it did, on a loaded machine)
            transport.message_ttl = fed.open_timeout + fed.collect_timeout + grace
            if evaluate_fn is not None and coordinator.global_state().round == 0:  # not resumed
                res = evaluate_fn(0, initial_arrays)
                say(INFO, "Initial global evaluation results: %s", res)
                if res is not None:
                    result.evaluate_metrics_serverapp[0] = res
        # a resumed run continues to the same total (num_rounds counts from round 1); the
        # round number is the coordinator's, Flower's: round r takes θ_{r-1} to θ_r
        seen = len(coordinator.outcomes)  # the outcomes reported so far
        try:
            if done > 0:  # resumed: the run's model, whether or not a round is left to run
                result.arrays = self._user_arrays(coordinator.global_state().params)
            while (r := coordinator.global_state().next_round) <= num_rounds:
                say(INFO, "")
                say(INFO, "[ROUND %s/%s]", r, num_rounds)
                try:
                    coordinator.run(1)
                finally:
                    transport.message_ttl = fed.open_timeout + fed.collect_timeout  # grace is spent
                    new = coordinator.outcomes[seen:]
                    result.outcomes.extend(new)
                    aborted = [o.reason or "" for o in new if o.state is RoundState.ABORTED]
                    if aborted:
                        result.aborted[r] = aborted
                closed = new[-1]
                seen = len(coordinator.outcomes)  # an attempt opened below is the next round's
                not_opened: Exception | None = None
                if r < num_rounds and self._opens_ahead(evaluate_fn):
                    # Only lensemble's own bookkeeping comes between the rounds: the next
                    # round's instructions go out now, and this round's metrics and log
                    # lines are written while the nodes train. An error opening it is
                    # raised once this round is reported.
                    try:
                        coordinator.open_attempt()
                    except Exception as exc:
                        not_opened = exc
                result.arrays = self._user_arrays(coordinator.global_state().params)
                metrics = self._metrics(closed, attempts=len(new))
                result.train_metrics_clientapp[r] = metrics
                say(INFO, "\t└──> Aggregated MetricRecord: %s", metrics)
                evaluation = self._evaluate(r, result.arrays, evaluate_config, timeout)
                if evaluation is not None:
                    result.evaluate_metrics_clientapp[r] = evaluation
                    say(INFO, "\t└──> Aggregated evaluation MetricRecord: %s", evaluation)
                if evaluate_fn is not None:  # in FedAvg's order, with its lines
                    say(INFO, "Global evaluation")
                    res = evaluate_fn(r, result.arrays)
                    say(INFO, "\t└──> MetricRecord: %s", res)
                    if res is not None:
                        result.evaluate_metrics_serverapp[r] = res
                self._report(closed, metrics, evaluation, aborted)
                self._keep_metrics(r, metrics, evaluation)
                transport.forget_through(r)  # reported: its bookkeeping is no longer needed
                if not_opened is not None:
                    raise not_opened
        finally:  # the temp files made ahead of writes can go, however the run ended
            coordinator.store.close()
        recycling.clear()  # the run is over: the last sum's buffers need not stay resident
        say(INFO, "")
        say(INFO, "Strategy execution finished in %.2fs", time.time() - t_start)
        say(INFO, "")
        say(INFO, "Final results:")
        say(INFO, "")
        for line in str(result).splitlines():
            say(INFO, "\t%s", line)
        say(INFO, "")
        return result

    # -- helpers -----------------------------------------------------------------------
    @contextlib.contextmanager
    def _undone_if_it_fails(self) -> Iterator[None]:
        """``start``'s steps before its first round: if one raises, the run it began is
        taken back (the store's folders it made, and the run directory if it made it),
        so that the same start can run once the cause is fixed (:mod:`.unstarted_run`).
        A run directory that held a run before is left as it is."""
        before = RunDirBefore.of(self.run_dir)
        try:
            yield
        except BaseException:
            coordinator, run_dir = self.coordinator, self.run_dir
            if run_dir is not None and "names" not in before.present:
                if coordinator is not None:
                    coordinator.store.close()
                removed = before.restore(run_dir)
                if not (run_dir / "names").exists():  # the run is gone
                    log.info(
                        "the run did not reach its first round: removed %s",
                        ", ".join(str(path) for path in removed) or "nothing",
                    )
                    self.coordinator = None
                    if before.path is None and not run_dir.exists():
                        self.run_dir = None
            raise

    def _warm_up(self, transport: GridTransport, done: int, num_rounds: int) -> float:
        """Before the run's first round here: wait (at most ``warmup_timeout``) for the
        nodes every round needs, sending them nothing; nothing to wait for when the run
        already holds its ``num_rounds`` (``done`` of them closed). The seconds waited.

        Raises:
            ConfigError: fewer nodes connected than ``min_available_nodes``,
                ``min_train_nodes`` or the quorum K, naming the one that cannot be met
                and how to run the app.
        """
        fed = self.config.federation
        if done >= num_rounds:
            if done > 0:
                say(
                    INFO,
                    "%s already holds round %d, and num_rounds = %d counts from round 1: "
                    "no round left to run",
                    self.run_dir,
                    done,
                    num_rounds,
                )
            else:
                say(INFO, "num_rounds = %d: no round to run", num_rounds)
            return 0.0
        started = transport.now()
        # FedAvg waits for max(min_available_nodes, its sample size >= min_train_nodes)
        floor = max(fed.min_available, fed.sample_min)
        warm = transport.warm_up(min_nodes=max(fed.quorum, floor), timeout_s=self.warmup_timeout)
        waited = transport.now() - started
        say(INFO, "warm-up: %d node(s) connected after %.1fs", len(warm), waited)
        declared = transport.declared_size()  # the simulation engine's fixed node count
        connected = (
            f"the simulation engine runs {declared} node(s)"
            if declared is not None and len(warm) >= declared
            else f"{len(warm)} node(s) connected within the warm-up ({self.warmup_timeout:.0f} s)"
        )
        if fed.quorum <= len(warm) < floor:
            argument, key = (
                ("min_available_nodes", "min-available")
                if fed.min_available >= fed.sample_min
                else ("min_train_nodes", "sample-min")
            )
            raise ConfigError(
                key,
                f"{connected}, and no round starts before {argument} = {floor} "
                "are (FedAvg would wait for them for ever): start more SuperNodes (on "
                f'the simulation engine `--federation-config "num-supernodes={floor}"`), '
                f"raise the warm-up timeout, or lower {argument} (the strategy's argument; "
                f"lensemble.{key} when the argument is not given)",
            )
        if len(warm) < fed.quorum:
            raise ConfigError(
                "min-participants",
                f"{connected}, and every round needs K = {fed.quorum}. On Flower's "
                f"simulation engine give the run at least {fed.quorum} SuperNodes "
                "(`flwr run <app> --stream "
                f'--federation-config "num-supernodes={fed.quorum}"`; Flower\'s default local '
                f"federation has 2); on a deployment, start at least {fed.quorum} SuperNodes "
                "(or raise the warm-up timeout); or lower lensemble.min-participants",
            )
        return waited

    def _opens_ahead(self, evaluate_fn: object) -> bool:
        """Whether ``start`` may send a round's instructions before it reports the last:
        only when no code of the user's runs in between (no ``evaluate_fn``, no federated
        evaluation, no ``on_round``, Flower's own train metrics aggregation). Instructions
        nobody pulls while a slow evaluation or callback runs could outlive their TTL,
        and a SuperLink drops an expired instruction with its reply; evaluation replies
        would also mix with the next round's."""
        return (
            evaluate_fn is None
            and self.on_round is None
            and self.train_metrics_aggr_fn is aggregate_metricrecords
            and not self._evaluates()
        )

    def writes_durably(self, grid: Grid) -> bool:
        """Whether the run directory's writes are fsynced on ``grid`` (``durable_writes``;
        by default, everywhere but on the simulation engine)."""
        if self.durable_writes is not None:
            return self.durable_writes
        return not is_simulation_grid(grid)

    def _keep_metrics(
        self, server_round: int, metrics: MetricRecord, evaluation: MetricRecord | None
    ) -> None:
        """Append this round's metrics to ``RUN_DIR/round-metrics.jsonl`` (the curves of
        ``lensemble-flwr report``); a failure to write it is logged, never fatal."""
        if self.run_dir is None:
            return
        try:
            durable = self.coordinator is None or self.coordinator.store.sync
            kinds = {"train": dict(metrics), "evaluate": dict(evaluation or {})}
            append_round_metrics(self.run_dir, server_round, kinds, durable=durable)
        except OSError as exc:
            log.warning("round %d: %s not written: %s", server_round, METRICS_NAME, exc)

    def _ensure_coordinator(
        self, grid: Grid, arrays: ArrayRecord, *, transport: Any = None
    ) -> Coordinator:
        if self.coordinator is None or transport is not None:
            if self.run_dir is None:
                self.run_dir = Path(tempfile.mkdtemp(prefix="lensemble-run-"))
            run_id = self.run_id or f"flwr-{_flower_run_id(grid)}"
            store = Store(self.run_dir, sync=self.writes_durably(grid))
            common: dict[str, Any] = {
                "transport": transport,
                "store": store,
                "gauge": self.gauge,
                "identities": self.identities,
            }
            if self.resume and store.bound("manifest"):
                self.coordinator = Coordinator.resume(self.config, **common)
                log.info("resumed at round %d", self.coordinator.global_state().next_round)
            else:
                if holds_a_run(store):  # said in the strategy's terms, not Coordinator's
                    how = (
                        "it has no run manifest, so it cannot be resumed"
                        if self.resume
                        else "or resume=True to continue that run"
                    )
                    raise StoreError(
                        f"{self.run_dir} already holds a run: give the strategy a fresh "
                        f"run_dir (or none: a new temporary one); {how}"
                    )
                self.coordinator = Coordinator(
                    self.config,
                    initial_params=ArrayLayout.split(arrays)[1],
                    run_id=run_id,
                    **common,
                )
            say(INFO, "\t├── run directory: %s", self.run_dir)
        return self.coordinator

    def _adopt_changes(self, server_round: int, arrays: ArrayRecord) -> None:
        """Train from ``arrays`` when something changed what ``aggregate_train`` returned.

        Flower's central-DP wrappers add their noise to the aggregate after lensemble
        committed it; the coordinator adopts the noised model as the round's external
        step, recorded in its manifest entries and ledger record (see
        ``coordinator.external_step``). Carried (integer) arrays are not federated: a
        change to them is logged and left out, as they travel as given.

        Raises:
            ParameterMismatch: ``arrays`` does not fit the global model (names, shapes,
                dtypes, non-finite values); nothing changes.
            IllegalTransition: the round already trained from another model.
        """
        returned, coordinator = self._returned, self.coordinator
        if returned is None or arrays is returned or coordinator is None:
            return
        layout = self._layout_of(arrays)
        if list(arrays) != list(returned):
            raise ParameterMismatch(
                f"round {server_round}: configure_train got arrays {list(arrays)[:5]}…, "
                f"not the global model's {list(returned)[:5]}…"
            )
        changed_carried = [
            name
            for name in layout.carried_names
            if not np.array_equal(arrays[name].numpy(), returned[name].numpy())
        ]
        if changed_carried:
            log.warning(
                "round %d: %s changed after aggregation; non-floating arrays are carried "
                "as given, so the change is not used",
                server_round,
                changed_carried,
            )
        federated = {n: arrays[n].numpy() for n in arrays if n not in layout.carried}
        step = coordinator.adopt(federated)
        if step is None:
            return
        self._returned = arrays
        say(
            INFO,
            "\t├── the global model was changed after lensemble committed it (a wrapping "
            "strategy's step such as Flower's central DP noise, or an aggregate_train "
            "override; change norm %.4g): "
            "round %d trains from the changed model, and its ledger record says so",
            step.change_norm,
            server_round,
        )
        scale = influence_scale(self.config.outer)
        if not self._said_influence and abs(scale - 1.0) > 1e-9:
            self._said_influence = True
            log.warning(
                "if that change is a DP wrapper's noise: the outer step (lr %.3g, momentum "
                "%.3g) scales each round's mean update by %.3g before it is added, so "
                "noise calibrated for FedAvg's step then has %.3g times its noise "
                "multiplier. For the wrapper's stated "
                "guarantee use FedAvg's step: lensemble.outer-lr = 1, "
                "lensemble.outer-momentum = 0",
                self.config.outer.lr,
                self.config.outer.momentum,
                scale,
                1.0 / scale,
            )

    def _named(self, coordinator: Coordinator, reply: Message) -> str:
        """The participant id of a reply's node, learning it from a lensemble reply that
        names its sender (the attempt then follows the new name)."""
        node = reply.metadata.src_node_id
        claimed = None if reply.has_error() else records.claimed_sender(reply.content)
        if claimed is not None and node != SUPERLINK_NODE_ID:
            try:
                address = self.names.learn(
                    node,
                    claimed,
                    connected=self._connected,
                    allowed=set(self.identities) if self.identities is not None else None,
                )
            except ValueError as exc:
                log.warning("a reply from node %d dropped: %s", node, exc)
                return self.names.name_of(node)
            if address is not None and not coordinator.rename(address, claimed):
                self.names.forget(node)
        return self.names.name_of(node)

    def _evaluation_sample(self, server_round: int, peers: list[str]) -> list[str]:
        """FedAvg's evaluation sample: ``max(int(N * fraction_evaluate),
        min_evaluate_nodes)`` of the N nodes (at most N; none at fraction 0), ranked by a
        SHA-256 of a seed of the round and each node's id."""
        if self.fraction_evaluate <= 0 or not peers:
            return []
        count = min(
            len(peers),
            max(1, int(len(peers) * self.fraction_evaluate), self.min_evaluate_nodes),
        )
        seed = derive_seed(self.config.federation.root_seed, "evaluate", server_round)
        return seeded_sample(peers, count, seed, "evaluate-sample")

    def _layout_of(self, arrays: ArrayRecord) -> ArrayLayout:
        """The user's array layout, taken from the first arrays the strategy is given."""
        if self.layout is None:
            self.layout = ArrayLayout.split(arrays)[0]
        return self.layout

    def _carried(self) -> Mapping[str, Any]:
        return self.layout.carried if self.layout is not None else {}

    def _user_arrays(self, params: Mapping[str, Any]) -> ArrayRecord:
        """The global params as the user's ArrayRecord: their names in their order, the
        carried arrays as given."""
        if self.layout is None:
            return records.arrays_to_record(params)
        return self.layout.to_record(params)

    def _evaluate_content(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord | None
    ) -> RecordDict:
        cfg = dict(config or {})
        cfg["server-round"] = server_round
        if self.coordinator is not None and self.coordinator.last_close is not None:
            # rides along, as on RoundOpen (in the one config record Flower's mods expect)
            cfg.update(records.encode_close(to_wire(self.coordinator.last_close)))
        return RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: ConfigRecord(cfg)})

    def _evaluates(self) -> bool:
        """Whether nodes are asked to evaluate: ``fraction_evaluate`` > 0, and not under DP
        or secure aggregation unless ``dp-release-metrics`` opts in (the participants
        refuse then: asking would cost an exchange per round, and a stock ClientApp would
        answer with un-noised per-node metrics). Said once in the log."""
        if self.fraction_evaluate <= 0:
            return False
        if metrics_released(self.config):
            return True
        if not self._said_no_evaluation:
            self._said_no_evaluation = True
            log.info(
                "no federated evaluation: under DP or secure aggregation the participants "
                "release no per-node metrics (set dp-release-metrics = true to opt in)"
            )
        return False

    def _evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord | None, timeout: float
    ) -> MetricRecord | None:
        transport = self.transport
        if transport is None or not self._evaluates():
            return None
        chosen = self._evaluation_sample(server_round, list(transport.peers()))
        contents = {p: self._evaluate_content(server_round, arrays, config) for p in chosen}
        replies = transport.request(contents, MessageType.EVALUATE, timeout_s=timeout)
        return self.aggregate_evaluate(server_round, replies)

    def _metrics(
        self,
        outcome: RoundOutcome,
        attempts: int = 1,
        client_metrics: list[RecordDict] | None = None,
    ) -> MetricRecord:
        """The round's metrics: the contributors' own metrics aggregated as FedAvg does,
        and lensemble's bookkeeping under ``lensemble.``."""
        book: dict[str, float] = {
            "C_t": float(outcome.count),
            "attempts": float(attempts),
            "aborted-attempts": float(attempts - (outcome.state is RoundState.CLOSED)),
            "seconds": float(outcome.elapsed),
            "late": float(len(outcome.late)),
            "rejected": float(outcome.rejected),
            "refused": float(len(outcome.refused)),
        }
        if "frame_drift" in outcome.diagnostics:
            book["frame-drift"] = float(outcome.diagnostics["frame_drift"])
        transport = self.transport
        if transport is not None:
            book["exchanges"] = float(transport.exchanges(outcome.round))
            sent, received = transport.round_bytes(outcome.round)
            book["bytes-sent"] = float(sent)  # this round's, not the run's so far
            book["bytes-received"] = float(received)
            if client_metrics is None:
                client_metrics = [
                    RecordDict({records.METRICS: MetricRecord(m)})
                    for (rnd, peer), m in sorted(transport.client_metrics.items())
                    if rnd == outcome.round and peer in outcome.contributors
                ]
        weighted = [c for c in client_metrics or [] if _weighted(c, self.weighted_by_key)]
        metrics = MetricRecord()
        if weighted:
            aggregated = _aggregated(
                self.train_metrics_aggr_fn, weighted, self.weighted_by_key, "train"
            )
            metrics = aggregated if aggregated is not None else MetricRecord()
        for key, value in book.items():
            metrics[BOOKKEEPING + key] = value
        return metrics

    def _report(
        self,
        outcome: RoundOutcome,
        metrics: MetricRecord,
        evaluation: MetricRecord | None,
        aborted: list[str],
    ) -> None:
        path = "→".join(s.value for s in outcome.path)
        parts = [f"round {outcome.round}: {path}", f"C_t={outcome.count}"]
        if evaluation is not None:
            parts += [
                f"{k}={float(v):.4f}"
                for k, v in evaluation.items()
                if k != "num-examples" and isinstance(v, (int, float))
            ]
        # a stock client's own train loss; lensemble participants report their last inner
        # mini-batch as last-batch-loss, which is not comparable with an evaluation, so
        # it stays out of the line (it is in the round's MetricRecord)
        for key in ("train_loss",):
            if isinstance(metrics.get(key), (int, float)):
                parts.append(f"{key}={float(metrics[key]):.4f}")
        if BOOKKEEPING + "frame-drift" in metrics:
            parts.append(f"drift={float(metrics[BOOKKEEPING + 'frame-drift']):.4f}")
        if BOOKKEEPING + "exchanges" in metrics:  # not counted in Flower's own loop
            parts.append(f"exchanges={float(metrics[BOOKKEEPING + 'exchanges']):.0f}")
            parts.append(f"sent={float(metrics[BOOKKEEPING + 'bytes-sent']) / 1e6:.2f}MB")
        if aborted:
            parts.append(f"aborted={len(aborted)} ({aborted[-1]})")
        line = " ".join(parts)
        say(INFO, "\t├──> %s", line)
        if self.on_round is not None:
            self.on_round(line)


def with_sampling(config: LensembleConfig, **given: float | int | None) -> LensembleConfig:
    """``config`` with the sampling fields given (not None) replaced, validated.

    Raises:
        ConfigError: a value out of range, named by the strategy argument that gave it
            (``fraction_train``, ``min_train_nodes``, ``min_available_nodes``).
    """
    updates = {field: value for field, value in given.items() if value is not None}
    if not updates:
        return config
    try:
        federation = FederationConfig(**{**config.federation.model_dump(), **updates})
    except ConfigError as exc:  # said in the strategy's terms: the argument, as given
        for field, argument in _SAMPLING_ARGUMENTS.items():
            if exc.field.endswith(f".{field}") and field in updates:
                raise ConfigError(argument, exc.reason) from None
        raise
    return config.model_copy(update={"federation": federation})


_SAMPLING_ARGUMENTS = {
    "sample_fraction": "fraction_train",
    "sample_min": "min_train_nodes",
    "min_available": "min_available_nodes",
}
"""The federation config's sampling fields, by the strategy argument that sets them."""


def _check_arguments(
    config: object,
    identities: Mapping[str, str] | None,
    *,
    seconds: Mapping[str, object],
    keys: Mapping[str, object],
    callbacks: Mapping[str, object],
) -> None:
    """Refuse, naming the argument, what would only fail once the run started (an
    untyped ``AttributeError``, a key library's error, ``time.sleep``'s ValueError, or a
    SuperLink pulled in a tight loop).

    Raises:
        ConfigError: ``config`` is not a LensembleConfig (FedAvg's first positional
            argument is ``fraction_train``), ``poll_interval`` is not a finite number
            > 0 or ``warmup_timeout`` not one >= 0, an ``identities`` value is not an
            OpenSSH ECDSA public key, a record key or ``weighted_by_key`` is not a
            non-empty string, or a callback is not callable.
    """
    if config is not None and not isinstance(config, LensembleConfig):
        raise ConfigError(
            "config",
            f"must be a LensembleConfig (or None), got {config!r}: FedAvg's arguments "
            "(fraction_train=..., min_train_nodes=...) are given by name",
        )
    for name, value in seconds.items():
        floor = "> 0" if name == "poll_interval" else ">= 0"
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ConfigError(name, f"must be a number of seconds, got {value!r}")
        if not math.isfinite(value) or (value <= 0 if floor == "> 0" else value < 0):
            raise ConfigError(name, f"must be a finite number of seconds {floor}, got {value!r}")
    for pid, key in (identities or {}).items():
        try:
            parse_public_key(key if isinstance(key, str) else repr(key))
        except ForgedMessage as exc:
            raise ConfigError(f"identities[{pid!r}]", str(exc)) from None
    for name, value in keys.items():
        if not isinstance(value, str) or not value:
            raise ConfigError(name, f"must be a non-empty string, got {value!r}")
    for name, callback in callbacks.items():
        if callback is not None and not callable(callback):
            raise ConfigError(name, f"must be callable (or None), got {callback!r}")


def _weighted(content: RecordDict, key: str) -> bool:
    """A reply content FedAvg would aggregate: one MetricRecord, holding ``key`` as a
    finite, positive number (a zero or negative weight would divide by zero or flip the
    mean; such a reply's metrics are left out, never a crash)."""
    return _not_weighted(content, key) is None


def _not_weighted(content: RecordDict, key: str) -> str | None:
    """Why a reply content cannot be averaged by ``key`` (None: it can, see
    :func:`_weighted`)."""
    records_ = list(records.records_of(content, MetricRecord).values())
    if len(records_) != 1:
        return f"{len(records_)} MetricRecords, where one is averaged"
    if key not in records_[0]:
        return f"no {key!r} in its MetricRecord"
    weight = records_[0][key]
    if (
        isinstance(weight, (int, float))
        and not isinstance(weight, bool)
        and math.isfinite(weight)
        and weight > 0
    ):
        return None
    return f"{key!r} is {weight!r}, not a finite number > 0"


def _aggregated(
    aggregate: MetricsAggregation, contents: list[RecordDict], key: str, what: str
) -> MetricRecord | None:
    """``aggregate(contents, key)``, or None (logged) when the metrics do not aggregate
    (e.g. list metrics of different lengths): the round is committed already."""
    try:
        return aggregate(contents, key)
    except Exception:  # the user's function, or Flower's on mismatched metrics
        log.exception("%s metrics could not be aggregated; left out of the result", what)
        return None


def _flower_run_id(grid: Grid) -> str:
    try:
        return str(grid.run.run_id)
    except Exception:  # a Grid without a run (tests): name the run by its object
        return f"{id(grid):x}"
