"""The digits Flower App (apps/digits): a small classifier on scikit-learn's digits,
non-IID over 10 nodes.

``flwr run apps/digits`` (or ``APP=apps/digits ./dev.sh main``) runs it on Flower's local
simulation engine. The ServerApp is a :class:`LensembleStrategy`; the ClientApp is a
lensemble participant whose trainer holds this node's partition (``partition-id`` from
the node config). Every setting comes from ``[tool.flwr.app.config]``; see
``docs/configuration.md``.

Beside the federated model, each node trains a local-only model (``local-only``, on by
default): from the same initial weights, as many AdamW steps on the same batches, never
sent (:mod:`~lensemble_flwr.simulations.local_only`). Each evaluation reports, per node,
the global and the local-only model's accuracy and loss on the node's own test split;
the round line shows their means over the nodes and ``nodes-beating-local``, and the run
ends with a per-node table of the last round. Under DP or secure aggregation the nodes
send no evaluation (their metrics are not noised): only the server's numbers are shown.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from lensemble_flwr.clients.app import config_from_context, make_client_app
from lensemble_flwr.clients.state import load_state
from lensemble_flwr.clients.threads import use_torch_threads
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.participant.participant import training_state
from lensemble_flwr.simulations.digits_data import (
    DigitsTrainer,
    centralized_evaluate,
    initial_params,
    load_partition,
    model_class_of,
)
from lensemble_flwr.simulations.flower_app import (
    PerNodeMetrics,
    checked_config,
    partition_of,
    start_and_report,
    strategy_from_context,
)
from lensemble_flwr.simulations.local_only import LocalOnlyTraining, local_only_of
from lensemble_flwr.strategies.records import arrays_to_record, record_to_arrays

NODE, EXAMPLES = "node", "num-examples"
GLOBAL_ACC, LOCAL_ACC = "global-accuracy", "local-only-accuracy"
GLOBAL_LOSS, LOCAL_LOSS = "global-loss", "local-only-loss"


class DigitsTraining(LocalOnlyTraining):
    """AdamW over a :class:`DigitsTrainer` and, with ``local_only``, the node's local-only
    classifier (the trainer's model class and initial seed) trained beside it."""

    def __init__(
        self, trainer: DigitsTrainer, config: LensembleConfig, *, local_only: bool = True
    ) -> None:
        model = trainer.model_class(seed=trainer.init_seed) if local_only else None
        super().__init__(trainer, config, local_model=model)
        self.digits = trainer

    def local_only_evaluate(self) -> tuple[float, float, int] | None:
        """(loss, accuracy, number of examples) of the local-only model on the node's test
        split; None without a local-only model."""
        if self.local_only is None:
            return None
        return self.digits.evaluate_model(self.local_only.model)


def check_app_keys(run_config: Mapping[str, Any]) -> None:
    """Refuse the app's own keys that its nodes would refuse, before the ServerApp asks
    the Grid anything.

    Raises:
        ConfigError: the key and why.
    """
    model_class_of(run_config.get("model", "net"))
    local_only_of(run_config)


def trainer_fn(context: Context) -> DigitsTraining:
    """This node's partition of the digits and a fresh model, with its saved state (its
    inner optimizer and local-only model) restored from ``context.state``."""
    run = context.run_config
    partition_id, count = partition_of(context, default_count=10)
    seed = int(run.get("data-seed", 0))
    model_class = model_class_of(run.get("model", "net"))
    trainer = DigitsTrainer(load_partition(partition_id, count, seed=seed), model_class=model_class)
    training = DigitsTraining(trainer, config_from_context(context), local_only=local_only_of(run))
    training.import_state(training_state(load_state(context.state)))
    return training


def evaluate_fn(
    training: DigitsTraining, params: Mapping[str, np.ndarray], config: Mapping[str, Any]
) -> dict[str, float]:
    """The global model's accuracy and loss on the node's test split and, when the node
    keeps one, its local-only model's on the same examples."""
    loss, accuracy, count = training.digits.evaluate(params)
    metrics = {
        NODE: float(training.digits.partition.partition_id),
        GLOBAL_ACC: accuracy,
        GLOBAL_LOSS: loss,
        EXAMPLES: float(count),
    }
    local = training.local_only_evaluate()
    if local is not None:
        metrics[LOCAL_LOSS], metrics[LOCAL_ACC] = local[0], local[1]
    return metrics


client_app = make_client_app(trainer_fn, evaluate_fn=evaluate_fn)

server_app = ServerApp()


def per_node_metrics() -> PerNodeMetrics:
    """The app's ``evaluate_metrics_aggr_fn``: the means over the nodes (each counts once)
    and how many nodes the global model serves at a higher accuracy than their local-only
    one (a tie does not count)."""
    means = (GLOBAL_ACC, LOCAL_ACC, GLOBAL_LOSS, LOCAL_LOSS)
    return PerNodeMetrics(means, GLOBAL_ACC, LOCAL_ACC, NODE, higher_is_better=True)


def node_table(per_node: PerNodeMetrics) -> str:
    """The per-node table of the last round's evaluation: the global model against the
    node's local-only one on the node's test split, and the count of nodes it beats."""
    lines = [
        "node  test examples  global acc  local-only acc  global loss  local-only loss  "
        "global better"
    ]
    beating = compared = 0
    for node, m in per_node.by_node.items():
        has_local = LOCAL_ACC in m and LOCAL_LOSS in m
        better = "-"
        if has_local:
            compared += 1
            beating += per_node.beats(m)
            better = "yes" if per_node.beats(m) else "no"
        local_acc = f"{m[LOCAL_ACC]:.4f}" if has_local else "-"
        local_loss = f"{m[LOCAL_LOSS]:.4f}" if has_local else "-"
        lines.append(
            f"{node:4d}  {m.get(EXAMPLES, 0):13.0f}  {m[GLOBAL_ACC]:10.4f}  {local_acc:>14}  "
            f"{m[GLOBAL_LOSS]:11.4f}  {local_loss:>15}  {better}"
        )
    if compared:
        lines.append(
            f"the global model beats local-only on {beating} of {compared} nodes "
            "(a higher accuracy on the node's own test split)"
        )
    return "\n".join(lines)


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the federation (one line per round through Flower's logger), then print the
    per-node table of the last round."""
    run_config = dict(context.run_config)
    # first: a bad value stops the run in seconds
    config = checked_config(context, lambda _: check_app_keys(run_config))
    use_torch_threads()  # the ServerApp evaluates beside the nodes (clients/threads.py)
    per_node = per_node_metrics()
    config, strategy = strategy_from_context(context, config, evaluate_metrics_aggr_fn=per_node)
    seed = int(run_config.get("data-seed", 0))
    count = int(run_config.get("num-partitions", 10))
    model_class = model_class_of(run_config.get("model", "net"))

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        loss, accuracy = centralized_evaluate(
            record_to_arrays(arrays), seed=seed, num_partitions=count, model_class=model_class
        )
        return MetricRecord({"loss": loss, "accuracy": accuracy})

    start_and_report(
        strategy,
        grid,
        context,
        config,
        initial_arrays=arrays_to_record(initial_params(model_class=model_class)),
        evaluate_fn=evaluate_fn,
        final_label="final centralized evaluation",
        final_metrics=lambda result: result.evaluate_metrics_serverapp,
    )
    if per_node.by_node:
        print(node_table(per_node), flush=True)
