"""Builders shared by the in-process federation tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.federation.coordinator import Coordinator
from lensemble_flwr.federation.participant import Participant
from lensemble_flwr.federation.transport import FaultPlan, InProcessNetwork
from lensemble_flwr.simulations.inprocess import build


def small_config(**federation: Any) -> LensembleConfig:
    fed = {"min_participants": 3, "open_timeout": 10.0, "collect_timeout": 10.0,
           "retry_wait": 1.0, "root_seed": 7}
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
) -> tuple[Coordinator, InProcessNetwork, list[Participant]]:
    return build(
        config or small_config(), tmp / name, participants=participants, faults=faults
    )
