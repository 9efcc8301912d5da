"""The digits app's federation in one process: the same partitions, model and trainer as
``apps/digits`` on Flower, driven by the package's Coordinator on a simulated clock.

:func:`run_digits` is what the privacy docs' examples are checked with (a few rounds,
each round's held-out accuracy) and what ``benchmarks/bench_dp_outer.py`` measures the
outer step under noise with.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.coordinator import RoundOutcome
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.simulations.digits_data import (
    DigitsNet,
    DigitsTrainer,
    centralized_evaluate,
    initial_params,
    load_partition,
)
from lensemble_flwr.simulations.inprocess import build


def with_budget_dir(config: LensembleConfig, budget_dir: Path) -> LensembleConfig:
    """``config`` whose participants keep their budgets under ``budget_dir``."""
    return LensembleConfig.from_flat({**config.to_flat(), "dp-state-dir": str(budget_dir)})


def run_digits(
    config: LensembleConfig,
    run_dir: Path,
    *,
    rounds: int,
    num_partitions: int = 10,
    data_seed: int = 0,
    on_accuracy: Callable[[int, float, float], None] | None = None,
    model_class: Callable[..., nn.Module] = DigitsNet,
) -> list[float]:
    """Run ``rounds`` rounds of the digits app over ``num_partitions`` in-process
    participants (the app's non-IID split of ``data_seed``; each participant keeps its
    budget where ``config``'s ``dp-state-dir`` says), each training a ``model_class``
    (the app's ``model`` key, :func:`~lensemble_flwr.simulations.digits_data.model_class_of`),
    writing the run to ``run_dir``.

    Returns:
        The held-out accuracy (the union of the partitions' test splits, as the app's
        ServerApp evaluates) of the global model after each round; ``on_accuracy(round,
        loss, accuracy)`` is called as each round closes.
    """
    accuracies: list[float] = []

    def evaluate(outcome: RoundOutcome) -> None:
        if outcome.state is not RoundState.CLOSED:
            return
        params = coordinator.global_state().params
        loss, accuracy = centralized_evaluate(
            params, seed=data_seed, num_partitions=num_partitions, model_class=model_class
        )
        accuracies.append(accuracy)
        if on_accuracy is not None:
            on_accuracy(outcome.round, loss, accuracy)

    coordinator, _network, _nodes = build(
        config,
        run_dir,
        participants=num_partitions,
        on_round=evaluate,
        trainer_of=lambda i: DigitsTrainer(
            load_partition(i, num_partitions, seed=data_seed), model_class=model_class
        ),
        params=initial_params(model_class=model_class),
    )
    coordinator.run(rounds)
    return accuracies
