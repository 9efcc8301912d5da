"""The round runtime: coordinator, participant, state machine, messages and transports."""

from lensemble_flwr.federation.coordinator import Coordinator, RoundOutcome
from lensemble_flwr.federation.participant import Participant
from lensemble_flwr.federation.round import GlobalState, PseudoGradient, RoundEvent, RoundState
from lensemble_flwr.federation.transport import FaultPlan, InProcessNetwork, Transport

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
