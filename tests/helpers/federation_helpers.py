"""Builders shared by the in-process federation tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.coordinator import (
    AggregatorFactory,
    Coordinator,
    fixed_point_aggregator,
)
from lensemble_flwr.identity.signing import IdentityKey
from lensemble_flwr.participant.participant import Participant
from lensemble_flwr.simulations.inprocess import build
from lensemble_flwr.simulations.toy import ToyTrainer, initial_params
from lensemble_flwr.transports.faults import FaultPlan
from lensemble_flwr.transports.inprocess import InProcessNetwork


def dp_config(state_dir: Path, **privacy: Any) -> LensembleConfig:
    """:func:`small_config` with clipped, noised releases whose budgets live in
    ``state_dir`` (epsilon 200 unless ``privacy`` says otherwise)."""
    base = small_config()
    return LensembleConfig(
        federation=base.federation.model_dump(),
        inner=base.inner.model_dump(),
        privacy={
            "clip_norm": 0.5,
            "noise_multiplier": 1.0,
            "dp_epsilon": 200.0,
            "dp_state_dir": str(state_dir),
            **privacy,
        },
    )


def small_config(**federation: Any) -> LensembleConfig:
    fed = {
        "min_participants": 3,
        "open_timeout": 10.0,
        "collect_timeout": 10.0,
        "retry_wait": 1.0,
        "root_seed": 7,
    }
    fed.update(federation)
    return LensembleConfig(
        federation=fed,
        inner={"steps": 2, "lr": 0.05, "batch_size": 8},
    )


def federation(
    tmp: Path,
    *,
    participants: int = 4,
    faults: FaultPlan | None = None,
    config: LensembleConfig | None = None,
    name: str = "run",
    aggregator_factory: AggregatorFactory = fixed_point_aggregator,
    **models: Any,
) -> tuple[Coordinator, InProcessNetwork, list[Participant]]:
    """:func:`~lensemble_flwr.simulations.inprocess.build` under ``tmp / name``; ``models``
    (``trainer_of``, ``params``) replace the toy task."""
    return build(
        config or small_config(),
        tmp / name,
        participants=participants,
        faults=faults,
        aggregator_factory=aggregator_factory,
        **models,
    )


def signed_federation(
    tmp: Path,
    keys: dict[str, IdentityKey],
    *,
    config: LensembleConfig | None = None,
    faults: FaultPlan | None = None,
    identities: dict[str, str] | None = None,
    unsigned: tuple[str, ...] = (),
) -> tuple[Coordinator, InProcessNetwork, list[Participant]]:
    """Participants ``keys`` (id -> identity key; those in ``unsigned`` sign nothing)
    and a coordinator with the optional allow-list ``identities``."""
    config = config or small_config()
    network = InProcessNetwork(faults=faults, join_endpoint=str(tmp / "run"))
    nodes = []
    for i, pid in enumerate(sorted(keys)):
        node = Participant(
            config,
            participant_id=pid,
            transport=network.transport_for(pid),
            trainer=ToyTrainer(i),
            identity=None if pid in unsigned else keys[pid],
        )
        network.attach(node)
        nodes.append(node)
    coordinator = Coordinator(
        config,
        transport=network.coordinator,
        initial_params=initial_params(),
        store=Store(tmp / "run"),
        identities=identities,
    )
    return coordinator, network, nodes
