"""The world model's federation in one process: participants, coordinator, validation.

:func:`build_world` wires a :class:`~lensemble_flwr.coordinator.coordinator.Coordinator`
and world-model participants on an :class:`InProcessNetwork` (a simulated clock, so a
round costs only its compute). Alignment follows the config: with ``gauge-align`` every
participant aligns its trained weights on the public probe before release and the
coordinator announces the probe and checks the sketch. :func:`validation_loss` is the
experiment's measure of a global model.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.coordinator import Coordinator, RoundOutcome
from lensemble_flwr.gauge.runtime import GaugeSetup
from lensemble_flwr.participant.participant import Participant
from lensemble_flwr.simulations.world_data import participant_data, public_probe
from lensemble_flwr.simulations.world_model import (
    WorldModelAdapter,
    WorldTrainer,
    WorldTraining,
    initial_params,
)
from lensemble_flwr.transports.faults import FaultPlan
from lensemble_flwr.transports.inprocess import InProcessNetwork


@dataclasses.dataclass
class WorldFederation:
    """What :func:`build_world` wired, for driving and inspecting a run."""

    coordinator: Coordinator
    network: InProcessNetwork
    participants: list[Participant]
    trainers: list[WorldTrainer]
    gauge: GaugeSetup


@functools.lru_cache(maxsize=8)
def world_gauge(seed: int = 0) -> GaugeSetup:
    """The world model's gauge adapter and the world's public probe (cached: a SuperNode
    asks for it on every message, and the probe's hashes are computed once)."""
    return GaugeSetup(adapter=WorldModelAdapter(), probe=public_probe(seed))


def build_world(
    config: LensembleConfig,
    run_dir: Path,
    *,
    participants: int,
    data_seed: int = 0,
    init_seed: int = 0,
    rotate_start: bool = False,
    trajectories: int = 16,
    steps: int = 32,
    validation_trajectories: int = 8,
    actuation: str = "subspace",
    faults: FaultPlan | None = None,
    on_round: Callable[[RoundOutcome], None] | None = None,
) -> WorldFederation:
    """A coordinator and ``participants`` world-model participants on one network.

    Args:
        config: the federation config; ``gauge-align`` switches participant-side
            alignment on.
        run_dir: a fresh directory for the coordinator's store.
        participants: how many embodiments (participant i is embodiment i).
        data_seed: the world and its data.
        init_seed: the initial global model.
        rotate_start: every participant trains in its own randomly rotated latent frame
            (see :class:`~lensemble_flwr.simulations.world_model.WorldTraining`).
        trajectories, steps, validation_trajectories, actuation: each participant's data
            (:func:`~lensemble_flwr.simulations.world_data.participant_data`).
        faults: scripted faults of the in-process network.
        on_round: called with every round outcome.
    """
    gauge = world_gauge(data_seed)
    network = InProcessNetwork(faults=faults, join_endpoint=str(run_dir))
    nodes, trainers = [], []
    for i in range(participants):
        pid = f"p{i:02d}"
        data = participant_data(
            i,
            seed=data_seed,
            trajectories=trajectories,
            steps=steps,
            validation_trajectories=validation_trajectories,
            actuation=actuation,
        )
        trainer = WorldTrainer(data, init_seed=init_seed)
        training = WorldTraining(
            trainer, config, rotate_start=rotate_start, rotation_seed=data_seed
        )
        node = Participant(
            config,
            participant_id=pid,
            transport=network.transport_for(pid),
            trainer=training,
            gauge=gauge,
        )
        network.attach(node)
        nodes.append(node)
        trainers.append(trainer)
    coordinator = Coordinator(
        config,
        transport=network.coordinator,
        initial_params=initial_params(init_seed),
        store=Store(run_dir),
        on_round=on_round,
        gauge=gauge,
    )
    return WorldFederation(coordinator, network, nodes, trainers, gauge)


def validation_loss(params: Mapping[str, np.ndarray], trainers: Sequence[WorldTrainer]) -> float:
    """Mean over participants of the loss on their validation sets, with each one's own
    (local) action head and the shared ``params``.

    The loss is invariant under a change of latent frame of the shared weights, and the
    action heads do not carry the frame, so this measures the global model whatever
    frame it is in.
    """
    return float(np.mean([t.validation_loss(params) for t in trainers]))
