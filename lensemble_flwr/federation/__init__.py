"""The round runtime: coordinator, participant, state machine, messages and transports.

The names below are resolved on first use. The release pipeline and the gauge package
build on :mod:`.round` and :mod:`.messages`, while the participant and the coordinator
build on them: importing ``lensemble_flwr.federation.round`` must not import the
coordinator (and with it the release pipeline) first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Coordinator": "coordinator",
    "RoundOutcome": "coordinator",
    "Participant": "participant",
    "GlobalState": "round",
    "PseudoGradient": "round",
    "RoundEvent": "round",
    "RoundState": "round",
    "FaultPlan": "transport",
    "InProcessNetwork": "transport",
    "Transport": "transport",
}

__all__ = [
    "Coordinator",
    "FaultPlan",
    "GlobalState",
    "InProcessNetwork",
    "Participant",
    "PseudoGradient",
    "RoundEvent",
    "RoundOutcome",
    "RoundState",
    "Transport",
]

if TYPE_CHECKING:
    from lensemble_flwr.federation.coordinator import Coordinator, RoundOutcome
    from lensemble_flwr.federation.participant import Participant
    from lensemble_flwr.federation.round import (
        GlobalState,
        PseudoGradient,
        RoundEvent,
        RoundState,
    )
    from lensemble_flwr.federation.transport import FaultPlan, InProcessNetwork, Transport


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
