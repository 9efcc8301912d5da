"""What the example Flower Apps share: their own run_config keys, the node's partition, a
LensembleStrategy built from the run config, and the run's start and final report.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from logging import ERROR
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, Context, MetricRecord, RecordDict
from flwr.common import log as say
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from lensemble_flwr.config import NAMESPACE, LensembleConfig, run_config_keys
from lensemble_flwr.errors import ConfigError

if TYPE_CHECKING:  # imported where a strategy is built: not in a ClientApp process
    from lensemble_flwr.strategies import LensembleStrategy


def partition_of(context: Context, default_count: int) -> tuple[int, int]:
    """This node's (partition id, partition count) from its node config (the simulation
    engine sets both; a SuperNode gets them from ``--node-config``)."""
    node = context.node_config
    count = int(node.get("num-partitions", context.run_config.get("num-partitions", default_count)))
    return int(node.get("partition-id", 0)) % count, count


def checked_config(
    context: Context, *checks: Callable[[LensembleConfig], None]
) -> LensembleConfig:
    """The run's federation config (the run config's ``lensemble.`` keys), checked by
    lensemble and by the app's own ``checks``: the first thing the example ServerApps do,
    before they build anything or ask the Grid anything, so that a bad value stops the
    run in seconds. A refused config is logged as one error line naming the run_config
    key (``lensemble.<key>``), then raised.

    Raises:
        ConfigError: the key and why it is refused.
    """
    try:
        config = LensembleConfig.from_run_config(context.run_config)
        for check in checks:
            check(config)
    except ConfigError as exc:
        if exc.field in run_config_keys():  # an app's check names the un-namespaced key
            exc = ConfigError(NAMESPACE + exc.field, exc.reason)
        say(ERROR, "the run config is refused, nothing was started: %s", exc)
        raise exc from None
    return config


def strategy_from_context(
    context: Context, config: LensembleConfig | None = None, **strategy_args: Any
) -> tuple[LensembleConfig, LensembleStrategy]:
    """The federation config (``config``, else :func:`checked_config`) and a strategy
    that writes to ``run-dir`` (or ``$LENSEMBLE_RUN_DIR``) / ``flwr-<run id>`` (its
    per-round lines go through Flower's logger)."""
    from lensemble_flwr.strategies import LensembleStrategy

    run_config = dict(context.run_config)
    config = config if config is not None else checked_config(context)
    run_dir = str(run_config.get("run-dir", "")) or os.environ.get("LENSEMBLE_RUN_DIR", "")
    strategy = LensembleStrategy(
        config,
        run_dir=Path(run_dir) / f"flwr-{context.run_id}" if run_dir else None,
        warmup_timeout=float(run_config.get("warmup-timeout", 120.0)),
        fraction_evaluate=float(run_config.get("fraction-evaluate", 1.0)),
        **strategy_args,
    )
    return config, strategy


def last_metrics(by_round: Mapping[int, MetricRecord]) -> dict[str, Any] | None:
    """The metrics of the latest round in ``by_round`` (None if there is none, or it is
    empty)."""
    final = by_round.get(max(by_round, default=0))
    return dict(final) if final else None


def evaluation_timeout(config: LensembleConfig) -> float:
    """How long a round's federated evaluation waits for the nodes: the collect timeout,
    or under adaptive deadlines their cap (what a round may wait at most)."""
    fed = config.federation
    return fed.deadline_cap if fed.deadline_mode == "adaptive" else fed.collect_timeout


def start_and_report(
    strategy: LensembleStrategy,
    grid: Grid,
    context: Context,
    config: LensembleConfig,
    *,
    initial_arrays: ArrayRecord,
    evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None],
    final_label: str,
    final_metrics: Callable[[Result], Mapping[int, MetricRecord]],
) -> Result:
    """Run ``num-server-rounds`` rounds (default 5), then print the run directory and
    ``final_label: <the latest round's final_metrics(result)>``."""
    result = strategy.start(
        grid=grid,
        initial_arrays=initial_arrays,
        num_rounds=int(context.run_config.get("num-server-rounds", 5)),
        timeout=evaluation_timeout(config),
        evaluate_fn=evaluate_fn,
    )
    print(f"run directory: {result.run_dir}", flush=True)
    print(f"{final_label}: {last_metrics(final_metrics(result))}", flush=True)
    return result


class PerNodeMetrics:
    """An app's ``evaluate_metrics_aggr_fn`` over per-node replies that carry their node
    (``node_key``): the mean over the nodes of each of ``means`` (each node counts once,
    non-finite values left out), and ``nodes-beating-local``, how many nodes ``better``
    serves better than ``worse``: a strictly lower value (a loss), or with
    ``higher_is_better`` a strictly higher one (an accuracy); a tie does not count. The
    round's per-node values stay in :attr:`by_node`."""

    def __init__(
        self,
        means: tuple[str, ...],
        better: str,
        worse: str,
        node_key: str = "node",
        *,
        higher_is_better: bool = False,
    ) -> None:
        self.means, self.better, self.worse, self.node_key = means, better, worse, node_key
        self.higher_is_better = higher_is_better
        self.by_node: dict[int, dict[str, float]] = {}

    def beats(self, metrics: Mapping[str, float]) -> bool:
        """Whether one node's ``better`` value beats its ``worse`` one (NaN never does)."""
        ours, theirs = metrics[self.better], metrics[self.worse]
        return ours > theirs if self.higher_is_better else ours < theirs

    def __call__(self, contents: list[RecordDict], weighting_key: str) -> MetricRecord:
        from lensemble_flwr.strategies.records import records_of

        nodes: dict[int, dict[str, float]] = {}
        for content in contents:
            for record in records_of(content, MetricRecord).values():
                values = {k: float(v) for k, v in record.items() if isinstance(v, (int, float))}
                if self.node_key in values:
                    nodes[int(values[self.node_key])] = values
        self.by_node = dict(sorted(nodes.items()))
        out: dict[str, int | float] = {}  # a count stays an integer
        for key in self.means:
            values = [m[key] for m in nodes.values() if math.isfinite(m.get(key, math.nan))]
            if values:
                out[key] = sum(values) / len(values)
        compared = [m for m in nodes.values() if self.better in m and self.worse in m]
        if compared:
            out["nodes-beating-local"] = sum(self.beats(m) for m in compared)
        return MetricRecord(out)
