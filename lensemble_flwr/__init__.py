"""lensemble-flwr: sovereign federated training for Flower.

The sans-I/O core is importable without Flower::

    from lensemble_flwr import Coordinator, Participant, LensembleConfig, RoundState

The Flower adapters live in :mod:`lensemble_flwr.strategies` (the coordinator as a
Strategy) and :mod:`lensemble_flwr.clients` (participants as ClientApps).

The names are resolved on first use, so that light entry points (the ``lensemble-flwr``
command, the shared-folder runner) do not pay for importing torch before they need it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LensembleConfig": "lensemble_flwr.config",
    "Coordinator": "lensemble_flwr.coordinator.coordinator",
    "GlobalState": "lensemble_flwr.protocol.state",
    "InProcessNetwork": "lensemble_flwr.transports.inprocess",
    "Participant": "lensemble_flwr.participant.participant",
    "PseudoGradient": "lensemble_flwr.protocol.state",
    "RoundState": "lensemble_flwr.protocol.round",
    "Transport": "lensemble_flwr.transports.base",
}

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

if TYPE_CHECKING:
    from lensemble_flwr.config import LensembleConfig
    from lensemble_flwr.coordinator.coordinator import Coordinator
    from lensemble_flwr.participant.participant import Participant
    from lensemble_flwr.protocol.round import RoundState
    from lensemble_flwr.protocol.state import GlobalState, PseudoGradient
    from lensemble_flwr.transports.base import Transport
    from lensemble_flwr.transports.inprocess import InProcessNetwork


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lensemble_flwr' has no attribute {name!r}")
