"""The default Flower App: a small classifier on scikit-learn's digits, non-IID over 10 nodes.

``flwr run .`` (from the repository root) runs it on Flower's local simulation engine.
The ServerApp is a :class:`LensembleStrategy`; the ClientApp is a lensemble participant
whose trainer holds this node's partition (``partition-id`` from the node config). Every
setting comes from ``[tool.flwr.app.config]``; see ``docs/configuration.md``.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from lensemble_flwr.clients.app import make_client_app
from lensemble_flwr.clients.threads import use_torch_threads
from lensemble_flwr.simulations.digits_data import (
    DigitsTrainer,
    centralized_evaluate,
    initial_params,
    load_partition,
    model_class_of,
)
from lensemble_flwr.simulations.flower_app import (
    checked_config,
    partition_of,
    start_and_report,
    strategy_from_context,
)
from lensemble_flwr.strategies.records import arrays_to_record, record_to_arrays


def trainer_fn(context: Context) -> DigitsTrainer:
    """This node's trainer: its partition of the digits, a fresh model."""
    partition_id, count = partition_of(context, default_count=10)
    seed = int(context.run_config.get("data-seed", 0))
    model_class = model_class_of(context.run_config.get("model", "net"))
    return DigitsTrainer(load_partition(partition_id, count, seed=seed), model_class=model_class)


client_app = make_client_app(trainer_fn)

server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the federation (one line per round through Flower's logger)."""
    config = checked_config(context)  # first: a bad value stops the run in seconds
    use_torch_threads()  # the ServerApp evaluates beside the nodes (clients/threads.py)
    run_config = dict(context.run_config)
    config, strategy = strategy_from_context(context, config)
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
