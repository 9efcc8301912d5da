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

The data keys (``trajectories``, ``trajectory-steps``, ``validation-trajectories``,
``actuation``) set each node's data; the defaults are the main job's setting, in which
every node has little data (48 transitions) and the embodiments drive one shared world
(``actuation = "full"``). Every evaluation reports, per node and averaged: the global
model's loss on the node's training data (``global-train-loss``) and on its validation
data (``global-val-loss``), both with the node's own head; and, unless
``baseline-cache = "off"``, the global model's loss on the scoring half of the node's
validation data (``global-held-out-loss``) against the node's tuned local-only baseline
on the same half (``local-only-held-out-loss``: its own model, learning rate and stopping
step chosen on the other half; :mod:`world_tuning`, cached by :mod:`world_baseline_cache`).
The run ends with a per-node table of the last round.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from lensemble_flwr.clients.app import config_from_context, make_client_app
from lensemble_flwr.clients.state import load_state
from lensemble_flwr.clients.threads import use_torch_threads
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.gauge.runtime import GaugeSetup
from lensemble_flwr.params import is_local, is_shared
from lensemble_flwr.participant.participant import training_state
from lensemble_flwr.simulations import flower_app
from lensemble_flwr.simulations.world_baseline_cache import tuned_local_only_result
from lensemble_flwr.simulations.world_data import participant_data
from lensemble_flwr.simulations.world_federation import world_gauge
from lensemble_flwr.simulations.world_model import (
    WorldTrainer,
    WorldTraining,
    initial_params,
)
from lensemble_flwr.simulations.world_tuning import split_validation
from lensemble_flwr.strategies.records import arrays_to_record, record_to_arrays

DATA_DEFAULTS: dict[str, Any] = {
    "trajectories": 2,
    "trajectory-steps": 24,
    "validation-trajectories": 8,
    "actuation": "full",
}
"""The app's data keys and their defaults (the main job's setting)."""
NODE, GLOBAL_TRAIN, GLOBAL_VAL, GLOBAL_HELD_OUT, LOCAL_HELD_OUT = (
    "node",
    "global-train-loss",
    "global-val-loss",
    "global-held-out-loss",
    "local-only-held-out-loss",
)


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


def data_settings(context: Context) -> dict[str, Any]:
    """:func:`participant_data`'s keyword arguments from the run config's data keys."""
    run = context.run_config
    get = {k: run.get(k, v) for k, v in DATA_DEFAULTS.items()}
    return {
        "trajectories": int(get["trajectories"]),
        "steps": int(get["trajectory-steps"]),
        "validation_trajectories": int(get["validation-trajectories"]),
        "actuation": str(get["actuation"]),
    }


def check_baseline_split(context: Context) -> None:
    """Refuse a run whose local-only baseline has no validation data to split.

    Raises:
        ConfigError: ``validation-trajectories`` < 2 while ``baseline-cache`` is not "off".
    """
    trajectories = data_settings(context)["validation_trajectories"]
    if baseline_cache(context) is not False and trajectories < 2:
        raise ConfigError(
            "validation-trajectories",
            f"the local-only baseline tunes on one half and scores on the other: it needs"
            f' >= 2, got {trajectories} (or set baseline-cache = "off")',
        )


def baseline_cache(context: Context) -> Path | bool | None:
    """The ``baseline-cache`` key: False for ``"off"``, None for the user-level default
    (empty), else the folder it names."""
    value = str(context.run_config.get("baseline-cache", ""))
    if value == "off":
        return False
    return Path(value) if value else None


def trainer_fn(context: Context) -> WorldTraining:
    """This node's world model and embodiment, with its local state (action head, inner
    optimizer) restored from ``context.state`` so that evaluation uses its own head."""
    config = config_from_context(context)
    check_groups(config)
    data_seed, init_seed = _seeds(context)
    partition, _count = flower_app.partition_of(context, default_count=6)
    trainer = WorldTrainer(
        participant_data(partition, seed=data_seed, **data_settings(context)), init_seed=init_seed
    )
    cache = baseline_cache(context)
    baseline = None
    if cache is not False:
        baseline = LocalOnlyBaseline(
            data=data_settings(context),
            data_seed=data_seed,
            init_seed=init_seed,
            cache_dir=cache,
        )
    training = NodeTraining(
        trainer,
        config,
        baseline=baseline,
        rotate_start=bool(context.run_config.get("rotate-start", False)),
        rotation_seed=data_seed,
    )
    training.import_state(training_state(load_state(context.state)))
    return training


def gauge_fn(context: Context) -> GaugeSetup:
    """The world model's gauge adapter and the world's public probe."""
    return world_gauge(_seeds(context)[0])


class NodeTraining(WorldTraining):
    """A node's :class:`WorldTraining` with what its local-only baseline depends on."""

    def __init__(
        self,
        trainer: WorldTrainer,
        config: LensembleConfig,
        *,
        baseline: LocalOnlyBaseline | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(trainer, config, **kwargs)
        self.baseline = baseline


@dataclasses.dataclass(frozen=True)
class LocalOnlyBaseline:
    """The run's settings of a node's tuned local-only baseline (``world_baseline_cache``)."""

    data: Mapping[str, Any]
    data_seed: int
    init_seed: int
    cache_dir: Path | None

    def held_out(self, index: int, config: LensembleConfig) -> float:
        """Node ``index``'s tuned local-only loss on the scoring half of its validation
        data."""
        result = tuned_local_only_result(
            index,
            self.data,
            config,
            data_seed=self.data_seed,
            init_seed=self.init_seed,
            cache_dir=self.cache_dir,
        )
        return result["score"]


def evaluate_fn(
    training: WorldTraining, params: Mapping[str, np.ndarray], config: Mapping[str, Any]
) -> dict[str, float]:
    """The node's losses of the global shared weights with its own action head: on its
    whole training set and on its validation set (no inner mini-batch), and, when the
    run keeps a baseline, on the scoring half of its validation set beside its tuned
    local-only baseline's loss there."""
    trainer = training.trainer
    assert isinstance(trainer, WorldTrainer)
    index = trainer.data.embodiment.index
    metrics = {
        NODE: float(index),
        GLOBAL_TRAIN: trainer.train_loss(params),
        GLOBAL_VAL: trainer.validation_loss(params),
        "num-examples": float(len(trainer.data.validation)),
    }
    baseline = getattr(training, "baseline", None)
    if baseline is not None:
        trajectories = int(baseline.data["validation_trajectories"])
        _tune, score = split_validation(trainer.data.validation, trajectories)
        metrics[GLOBAL_HELD_OUT] = trainer.loss_on(score, params)
        metrics[LOCAL_HELD_OUT] = baseline.held_out(index, training.config)
    return metrics


client_app = make_client_app(trainer_fn, evaluate_fn=evaluate_fn, gauge_fn=gauge_fn)

server_app = ServerApp()


def probe_moment_gap(gauge: GaugeSetup, params: Mapping[str, np.ndarray]) -> float:
    """||E[z zᵀ] − I||_F² / d of the global encoder on the public probe: the anti-collapse
    term on public data (frame-invariant; 0 for latents whitened on the probe)."""
    z = gauge.adapter.embed(params, gauge.probe.inputs).astype(np.float64)
    d = z.shape[1]
    return float(np.sum((z.T @ z / len(z) - np.eye(d)) ** 2) / d)


class PerNodeEvaluation(flower_app.PerNodeMetrics):
    """The world App's ``evaluate_metrics_aggr_fn``: each metric's mean over the nodes
    that replied (each node counts once), and how many of them the federation serves
    better than tuned local-only on held-out data; the last round's per-node metrics stay
    in :attr:`by_node` for the final table."""

    def __init__(self) -> None:
        means = (GLOBAL_TRAIN, GLOBAL_VAL, GLOBAL_HELD_OUT, LOCAL_HELD_OUT)
        super().__init__(means, GLOBAL_HELD_OUT, LOCAL_HELD_OUT, NODE)


def node_table(by_node: Mapping[int, Mapping[str, float]]) -> str:
    """The per-node table: the global model's losses, and on the scoring half of the
    node's validation data, the global model against the tuned local-only baseline."""
    lines = [
        "node  global-train-loss  global-val-loss  global-held-out-loss"
        "  local-only-held-out-loss  federated better",
    ]
    for node, m in by_node.items():
        fed, local = m.get(GLOBAL_HELD_OUT), m.get(LOCAL_HELD_OUT)
        better = "-" if fed is None or local is None else ("yes" if fed < local else "no")
        fed_text = "-" if fed is None else f"{fed:.4f}"
        local_text = "-" if local is None else f"{local:.4f}"
        lines.append(
            f"{node:4d}  {m[GLOBAL_TRAIN]:17.4f}  {m[GLOBAL_VAL]:15.4f}  {fed_text:>20}"
            f"  {local_text:>24}  {better}"
        )
    return "\n".join(lines)


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the federation (one line per round through Flower's logger), then print the
    per-node table of the last round."""
    # first: refused in seconds
    config = flower_app.checked_config(
        context, check_groups, lambda _config: check_baseline_split(context)
    )
    use_torch_threads()  # the ServerApp evaluates beside the nodes (clients/threads.py)
    data_seed, init_seed = _seeds(context)
    gauge = world_gauge(data_seed)
    per_node = PerNodeEvaluation()
    config, strategy = flower_app.strategy_from_context(
        context, config, gauge=gauge, evaluate_metrics_aggr_fn=per_node
    )

    def server_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        return MetricRecord({"probe-moment-gap": probe_moment_gap(gauge, record_to_arrays(arrays))})

    flower_app.start_and_report(
        strategy,
        grid,
        context,
        config,
        initial_arrays=arrays_to_record(initial_params(init_seed)),
        evaluate_fn=server_evaluate,
        final_label="final losses (mean over nodes, global model with each node's own head)",
        final_metrics=lambda result: result.evaluate_metrics_clientapp,
    )
    if per_node.by_node:
        print(node_table(per_node.by_node), flush=True)
