"""The latent world-model Flower App: sovereign embodiments aligning their latent frames.

``flwr run .`` with this app's components runs it on Flower's simulation engine. Every
node is one embodiment of a shared synthetic world (``partition-id`` picks which): its
own action dimension, sensors and private trajectories (:mod:`world_data`). The shared
groups ``encoder`` and ``predictor`` are federated; the ``action_head`` stays on the node.
With ``gauge-align`` (on in this app's defaults) each node aligns its trained weights to
the global latent frame on the pinned public probe before releasing them.

Run config: the lensemble keys under ``lensemble.`` (``docs/configuration.md``; this app
needs ``lensemble.shared-groups = "encoder,predictor"`` and ``lensemble.local-groups =
"action_head"``) and the app's own keys (``num-server-rounds``, ``init-seed``, ...).
``rotate-start = true`` makes every node train in its own randomly rotated latent frame
(the experiment of ``docs/gauge.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from lensemble_flwr.clients.app import config_from_context, make_client_app
from lensemble_flwr.clients.state import load_state
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.gauge.runtime import GaugeSetup
from lensemble_flwr.params import is_local, is_shared
from lensemble_flwr.participant.participant import training_state
from lensemble_flwr.simulations import flower_app
from lensemble_flwr.simulations.world_data import participant_data
from lensemble_flwr.simulations.world_federation import world_gauge
from lensemble_flwr.simulations.world_model import (
    WorldTrainer,
    WorldTraining,
    initial_params,
)
from lensemble_flwr.strategies.records import arrays_to_record, record_to_arrays


def check_groups(config: LensembleConfig) -> None:
    """Refuse groups that would share the action heads (their shapes differ per node).

    Raises:
        ConfigError: ``action_head`` is not local, or encoder/predictor are not shared.
    """
    if not is_local("action_head.weight", config.groups):
        raise ConfigError("local-groups", "the world model keeps 'action_head' local")
    for name in ("encoder.out.weight", "predictor.out.weight"):
        if not is_shared(name, config.groups):
            raise ConfigError("shared-groups", f"the world model shares {name.split('.')[0]!r}")


def _seeds(context: Context) -> tuple[int, int]:
    run = context.run_config
    return int(run.get("data-seed", 0)), int(run.get("init-seed", 0))


def trainer_fn(context: Context) -> WorldTraining:
    """This node's world model and embodiment, with its local state (action head, inner
    optimizer) restored from ``context.state`` so that evaluation uses its own head."""
    config = config_from_context(context)
    check_groups(config)
    data_seed, init_seed = _seeds(context)
    partition, _count = flower_app.partition_of(context, default_count=6)
    trainer = WorldTrainer(participant_data(partition, seed=data_seed), init_seed=init_seed)
    training = WorldTraining(
        trainer,
        config,
        rotate_start=bool(context.run_config.get("rotate-start", False)),
        rotation_seed=data_seed,
    )
    training.import_state(training_state(load_state(context.state)))
    return training


def gauge_fn(context: Context) -> GaugeSetup:
    """The world model's gauge adapter and the world's public probe."""
    return world_gauge(_seeds(context)[0])


def evaluate_fn(
    training: WorldTraining, params: Mapping[str, np.ndarray], config: Mapping[str, Any]
) -> dict[str, float]:
    """The node's validation loss of the global shared weights with its own action head."""
    trainer = training.trainer
    assert isinstance(trainer, WorldTrainer)
    return {
        "loss": trainer.validation_loss(params),
        "num-examples": len(trainer.data.validation),
    }


client_app = make_client_app(trainer_fn, evaluate_fn=evaluate_fn, gauge_fn=gauge_fn)

server_app = ServerApp()


def probe_moment_gap(gauge: GaugeSetup, params: Mapping[str, np.ndarray]) -> float:
    """||E[z zᵀ] − I||_F² / d of the global encoder on the public probe: the anti-collapse
    term on public data (frame-invariant; 0 for latents whitened on the probe)."""
    z = gauge.adapter.embed(params, gauge.probe.inputs).astype(np.float64)
    d = z.shape[1]
    return float(np.sum((z.T @ z / len(z) - np.eye(d)) ** 2) / d)


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the federation (one line per round through Flower's logger)."""
    data_seed, init_seed = _seeds(context)
    gauge = world_gauge(data_seed)
    config, strategy = flower_app.strategy_from_context(context, gauge=gauge)
    check_groups(config)

    def server_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        return MetricRecord({"probe-moment-gap": probe_moment_gap(gauge, record_to_arrays(arrays))})

    flower_app.start_and_report(
        strategy,
        grid,
        context,
        config,
        initial_arrays=arrays_to_record(initial_params(init_seed)),
        evaluate_fn=server_evaluate,
        final_label="final validation loss (nodes' own action heads)",
        final_metrics=lambda result: result.evaluate_metrics_clientapp,
    )
