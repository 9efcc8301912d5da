"""What a Flower run of lensemble reports: the result, each round's metrics and line.

* :class:`LensembleResult`: Flower's ``Result``, plus why attempts aborted and where the
  run directory is.
* :func:`round_metrics`: a round's MetricRecord, the contributors' own metrics
  aggregated as FedAvg does plus lensemble's bookkeeping under ``lensemble.``.
* :func:`report`: the round's one line, through Flower's logger and to ``on_round``.
* :func:`keep_metrics`: the round's line in ``RUN_DIR/round-metrics.jsonl`` (the curves
  of ``lensemble-flwr report``).
* :func:`log_summary` and :func:`log_final`: the lines FedAvg prints before and after.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from logging import INFO, WARNING
from pathlib import Path

from flwr.app import Message, MetricRecord, RecordDict
from flwr.common import log as say
from flwr.serverapp.strategy import Result

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.attempt import RoundOutcome
from lensemble_flwr.privacy.plan import PrivacyPlan
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.round_metrics import METRICS_NAME, append_round_metrics
from lensemble_flwr.strategies import records
from lensemble_flwr.strategies.traffic import RoundTraffic

log = logging.getLogger(__name__)

MetricsAggregation = Callable[[list[RecordDict], str], MetricRecord]
"""FedAvg's ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn``: (replies' contents,
the weighting key) -> the aggregated MetricRecord."""
BOOKKEEPING = "lensemble."
"""Prefix of lensemble's own per-round metrics (C_t, attempts, exchanges, bytes, ...)."""


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


def round_metrics(
    outcome: RoundOutcome,
    traffic: RoundTraffic,
    *,
    attempts: int,
    exchanges: bool,
    weighted_by_key: str,
    aggregate: MetricsAggregation,
    epsilon: float | None = None,
) -> MetricRecord:
    """The round's metrics: the contributors' own metrics (as the transport counted them)
    aggregated by ``aggregate`` as FedAvg does, and lensemble's bookkeeping under
    ``lensemble.`` (with ``exchanges``: the round's exchanges and bytes, which only a loop
    that moved the messages itself counts; with ``epsilon``, the largest cumulative ε a
    contributor claimed, as ``lensemble.epsilon``)."""
    book: dict[str, int | float] = {  # counts stay integers
        "C_t": int(outcome.count),
        "attempts": int(attempts),
        "aborted-attempts": int(attempts - (outcome.state is RoundState.CLOSED)),
        "seconds": float(outcome.elapsed),
        "late": len(outcome.late),
        "rejected": int(outcome.rejected),
        "refused": len(outcome.refused),
    }
    if epsilon is not None:
        book["epsilon"] = float(epsilon)
    if outcome.deadlines is not None:  # what the closing attempt waited for
        book["open-deadline"] = float(outcome.deadlines.open)
        book["collect-deadline"] = float(outcome.deadlines.collect)
    if outcome.round_time is not None:  # what adaptive deadlines follow
        book["round-time"] = float(outcome.round_time)
    if "frame_drift" in outcome.diagnostics:
        book["frame-drift"] = float(outcome.diagnostics["frame_drift"])
    if exchanges:
        book["exchanges"] = int(traffic.exchanges(outcome.round))
        sent, received = traffic.round_bytes(outcome.round)
        book["bytes-sent"] = int(sent)  # this round's, not the run's so far
        book["bytes-received"] = int(received)
    client_metrics = [
        RecordDict({records.METRICS: MetricRecord(m)})
        for (rnd, peer), m in sorted(traffic.client_metrics.items())
        if rnd == outcome.round and peer in outcome.contributors
    ]
    weighted_ = [c for c in client_metrics if weighted(c, weighted_by_key)]
    metrics = MetricRecord()
    if weighted_:
        aggregated_ = aggregated(aggregate, weighted_, weighted_by_key, "train")
        metrics = aggregated_ if aggregated_ is not None else MetricRecord()
    for key, value in book.items():
        metrics[BOOKKEEPING + key] = value
    return metrics


def report(
    outcome: RoundOutcome,
    metrics: MetricRecord,
    evaluation: MetricRecord | None,
    aborted: list[str],
    on_round: Callable[[str], None] | None,
    server: MetricRecord | None = None,
) -> None:
    """Say the round's line through Flower's logger, and hand it to ``on_round``: the
    federated ``evaluation``'s metrics, else (under DP, where nodes release none) the
    ServerApp's own evaluation's, as ``server-<key>``; the ε spent, under DP."""
    path = "→".join(s.value for s in outcome.path)
    parts = [f"round {outcome.round}: {path}", f"C_t={outcome.count}"]
    shown, prefix = (evaluation, "") if evaluation is not None else (server, "server-")
    if shown is not None:
        parts += [
            f"{prefix}{k}={_shown(v)}"
            for k, v in shown.items()
            if k != "num-examples" and isinstance(v, (int, float))
        ]
    if BOOKKEEPING + "epsilon" in metrics:
        parts.append(f"epsilon={float(metrics[BOOKKEEPING + 'epsilon']):.4g}")
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
    if on_round is not None:
        on_round(line)


def _shown(value: float) -> str:
    """A metric as the round line shows it: a count (an int) as it is, a measurement
    to four decimals."""
    return str(value) if isinstance(value, int) else f"{float(value):.4f}"


def say_received(kind: str, replies: list[Message]) -> None:
    """FedAvg's line for a batch of replies (``kind``: ``aggregate_train`` or
    ``aggregate_evaluate``): how many nodes replied with content, and how many with
    errors only. A masked round's node replies once per exchange, and counts once. Like
    FedAvg, nothing for no replies."""
    if not replies:
        return
    answered = {r.metadata.src_node_id for r in replies if not r.has_error()}
    failed = {r.metadata.src_node_id for r in replies if r.has_error()} - answered
    say(INFO, "%s: Received %s results and %s failures", kind, len(answered), len(failed))


def keep_metrics(
    run_dir: Path | None,
    server_round: int,
    metrics: MetricRecord,
    evaluation: MetricRecord | None,
    *,
    durable: bool,
    server: MetricRecord | None = None,
) -> None:
    """Append this round's metrics to ``RUN_DIR/round-metrics.jsonl`` (the curves of
    ``lensemble-flwr report``): the train replies' (``metrics``), the federated
    evaluation's (``evaluation``) and the server-side ``evaluate_fn``'s (``server``); a
    failure to write it is logged, never fatal."""
    if run_dir is None:
        return
    try:
        kinds = {
            "train": dict(metrics),
            "evaluate": dict(evaluation or {}),
            "server": dict(server or {}),
        }
        append_round_metrics(run_dir, server_round, kinds, durable=durable)
    except OSError as exc:
        log.warning("round %d: %s not written: %s", server_round, METRICS_NAME, exc)


def weighted(content: RecordDict, key: str) -> bool:
    """A reply content FedAvg would aggregate: one MetricRecord, holding ``key`` as a
    finite, positive number (a zero or negative weight would divide by zero or flip the
    mean; such a reply's metrics are left out, never a crash)."""
    return not_weighted(content, key) is None


def not_weighted(content: RecordDict, key: str) -> str | None:
    """Why a reply content cannot be averaged by ``key`` (None: it can, see
    :func:`weighted`)."""
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


def aggregated(
    aggregate: MetricsAggregation, contents: list[RecordDict], key: str, what: str
) -> MetricRecord | None:
    """``aggregate(contents, key)``, or None (logged) when the metrics do not aggregate
    (e.g. list metrics of different lengths): the round is committed already."""
    try:
        return aggregate(contents, key)
    except Exception:  # the user's function, or Flower's on mismatched metrics
        log.exception("%s metrics could not be aggregated; left out of the result", what)
        return None


def log_summary(config: LensembleConfig) -> None:
    """The federation's settings, through Flower's logger (as FedAvg's summary)."""
    fed, outer = config.federation, config.outer
    if fed.deadline_mode == "adaptive":
        deadlines = (
            f"adaptive deadlines: {fed.deadline_margin:g} x the recent round times, within "
            f"[{fed.deadline_floor:.0f}s, {fed.deadline_cap:.0f}s]"
        )
    else:
        deadlines = f"open {fed.open_timeout:.0f}s, collect {fed.collect_timeout:.0f}s"
    say(
        INFO,
        "\t├──> LensembleStrategy: quorum K=%d (min-participants %d, secagg-threshold "
        "%d), %s",
        fed.quorum,
        fed.min_participants,
        fed.secagg_threshold,
        deadlines,
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


def log_privacy_plan(plan: PrivacyPlan | None) -> None:
    """A noised run's privacy plan and forecast through Flower's logger, before round 1,
    with a WARNING when the forecast says the model cannot learn (:mod:`..privacy.plan`)."""
    if plan is None:
        return
    lines = plan.lines()
    for line in lines[:-1]:
        say(INFO, "\t├── %s", line)
    say(INFO, "\t└── %s", lines[-1])
    warning = plan.warning()
    if warning is not None:
        say(WARNING, "%s", warning)


def log_final(result: LensembleResult, started: float) -> None:
    """The closing lines of a run, as Flower's ``Strategy.start`` prints them."""
    say(INFO, "")
    say(INFO, "Strategy execution finished in %.2fs", time.time() - started)
    say(INFO, "")
    say(INFO, "Final results:")
    say(INFO, "")
    for line in str(result).splitlines():
        say(INFO, "\t%s", line)
    say(INFO, "")
