"""lensemble-flwr: sovereign federated training for Flower.

The sans-I/O core is importable without Flower::

    from lensemble_flwr import Coordinator, Participant, LensembleConfig, RoundState

The Flower adapters live in :mod:`lensemble_flwr.strategies` (the coordinator as a
Strategy) and :mod:`lensemble_flwr.clients` (participants as ClientApps).
"""

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.federation import (
    Coordinator,
    GlobalState,
    InProcessNetwork,
    Participant,
    PseudoGradient,
    RoundState,
    Transport,
)

__version__ = "0.1.0"

__all__ = [
    "Coordinator",
    "GlobalState",
    "InProcessNetwork",
    "LensembleConfig",
    "Participant",
    "PseudoGradient",
    "RoundState",
    "Transport",
    "__version__",
]
