"""The round state machine, the global state it pins, and the pseudo-gradient it consumes.

Every legal transition lives in :data:`TRANSITIONS`, one literal table (the idea of
h11's ``_state.py``). :meth:`RoundMachine.fire` is the only way a round changes
state; an event the table has no entry for raises :class:`IllegalTransition` and
leaves the machine exactly as it was.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from lensemble_flwr.canonical import digest_arrays
from lensemble_flwr.config import ParamGroupsConfig
from lensemble_flwr.errors import CheckpointIntegrityError, IllegalTransition, ResidencyViolation
from lensemble_flwr.params import NamedArrays, frozen, is_shared


class RoundState(str, enum.Enum):
    """Lifecycle of one outer round."""

    OPEN = "open"
    COLLECTING = "collecting"
    AGGREGATING = "aggregating"
    ALIGNING = "aligning"
    COMMITTING = "committing"
    CLOSED = "closed"
    ABORTED = "aborted"


class RoundEvent(str, enum.Enum):
    """What moves a round from one state to the next."""

    QUORUM_REACHED = "quorum-reached"
    """K participants joined and bound a valid commitment."""
    COLLECTION_CLOSED = "collection-closed"
    """Every expected update arrived, or the collect deadline passed with a quorum."""
    SUM_REPRODUCED = "sum-reproduced"
    """The aggregate passed the determinism self-check."""
    DIAGNOSED = "diagnosed"
    """Aggregate-level diagnostics were computed (no per-participant transform)."""
    COMMITTED = "committed"
    """The outer step was applied and the new global state hash-committed."""
    ABORT = "abort"
    """The round is discarded; the global state does not change."""


_S, _E = RoundState, RoundEvent
TRANSITIONS: Mapping[tuple[RoundState, RoundEvent], RoundState] = MappingProxyType(
    {
        (_S.OPEN, _E.QUORUM_REACHED): _S.COLLECTING,
        (_S.COLLECTING, _E.COLLECTION_CLOSED): _S.AGGREGATING,
        (_S.AGGREGATING, _E.SUM_REPRODUCED): _S.ALIGNING,
        (_S.ALIGNING, _E.DIAGNOSED): _S.COMMITTING,
        (_S.COMMITTING, _E.COMMITTED): _S.CLOSED,
        (_S.OPEN, _E.ABORT): _S.ABORTED,
        (_S.COLLECTING, _E.ABORT): _S.ABORTED,
        (_S.AGGREGATING, _E.ABORT): _S.ABORTED,
        (_S.ALIGNING, _E.ABORT): _S.ABORTED,
        (_S.COMMITTING, _E.ABORT): _S.ABORTED,
    }
)
TERMINAL_STATES = frozenset({RoundState.CLOSED, RoundState.ABORTED})


def next_state(state: RoundState, event: RoundEvent) -> RoundState:
    """The state ``event`` leads to from ``state``; IllegalTransition if there is none."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"no transition from {state.value!r} on {event.value!r}") from None


@dataclasses.dataclass
class RoundMachine:
    """The state of one round attempt. Created OPEN; ends CLOSED or ABORTED."""

    round: int
    attempt: int = 1
    state: RoundState = RoundState.OPEN
    history: list[tuple[RoundState, RoundEvent, RoundState]] = dataclasses.field(
        default_factory=list
    )
    abort_reason: str | None = None

    def fire(self, event: RoundEvent, *, reason: str | None = None) -> RoundState:
        """Apply ``event``; raise IllegalTransition (state unchanged) if it is not legal."""
        new = next_state(self.state, event)
        self.history.append((self.state, event, new))
        self.state = new
        if event is RoundEvent.ABORT:
            self.abort_reason = reason
        return new


def transition_diagram() -> str:
    """A Mermaid state diagram generated from :data:`TRANSITIONS` (used in the docs)."""
    lines = ["stateDiagram-v2", f"    [*] --> {RoundState.OPEN.name}"]
    for (source, event), target in TRANSITIONS.items():
        lines.append(f"    {source.name} --> {target.name}: {event.value}")
    lines += [f"    {s.name} --> [*]" for s in RoundState if s in TERMINAL_STATES]
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class GlobalState:
    """The pinned canonical state of round ``round``: exactly what RoundOpen broadcasts.

    ``params`` are read-only snapshots of the shared groups; ``params_hash`` is their
    canonical digest and is verified by :meth:`verify`.
    """

    round: int
    params: NamedArrays
    params_hash: str
    sketch_seed: int
    h_steps: int
    probe_hash: str = ""
    landmark_hashes: tuple[str, ...] = ()

    @classmethod
    def create(
        cls,
        round: int,
        params: Mapping[str, np.ndarray],
        *,
        sketch_seed: int,
        h_steps: int,
        probe_hash: str = "",
        landmark_hashes: tuple[str, ...] = (),
        copy: bool = True,
    ) -> GlobalState:
        """Snapshot ``params`` and compute their hash.

        With ``copy=False`` the arrays are adopted (made read-only, not copied): for a
        caller that just created them and keeps no other reference.
        """
        if copy:
            snap = frozen(params)
        else:
            snap = {name: params[name] for name in sorted(params)}
            for array in snap.values():
                array.setflags(write=False)
        return cls(
            round=round,
            params=snap,
            params_hash=digest_arrays(snap, "params"),
            sketch_seed=sketch_seed,
            h_steps=h_steps,
            probe_hash=probe_hash,
            landmark_hashes=landmark_hashes,
        )

    def verify(self) -> GlobalState:
        """Recompute the params hash; raise CheckpointIntegrityError if it differs."""
        actual = digest_arrays(self.params, "params")
        if actual != self.params_hash:
            raise CheckpointIntegrityError(
                f"round {self.round} global params hash {actual[:12]}… "
                f"does not match the announced {self.params_hash[:12]}…"
            )
        return self


def l2_norm(arrays: Mapping[str, np.ndarray]) -> float:
    """Global L2 norm over all arrays, accumulated in float64 in canonical order."""
    total = 0.0
    for name in sorted(arrays):
        flat = np.asarray(arrays[name], dtype=np.float64).ravel()
        total += float(np.dot(flat, flat))
    return math.sqrt(total)


@dataclasses.dataclass(frozen=True)
class PseudoGradient:
    """One participant's released update for one round, bound to its dataset commitment.

    ``delta`` is local − global over the shared groups after the release transforms;
    ``l2_norm`` is the norm of exactly what is released; ``transforms`` names the
    release stages applied, in order.
    """

    participant_id: str
    round: int
    delta: NamedArrays
    l2_norm: float
    dataset_root: str | None
    num_examples: int
    transforms: tuple[str, ...] = ()
    epsilon: float | None = None
    scales: dict[str, float] | None = None
    sketch_fingerprint: str | None = None
    groups: ParamGroupsConfig | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        """With ``groups``: refuse a delta that carries anything but shared parameters
        (action heads and other local groups never leave the participant)."""
        if self.groups is None:
            return
        leaked = sorted(n for n in self.delta if not is_shared(n, self.groups))
        if leaked:
            raise ResidencyViolation(
                f"{self.participant_id}: a release may carry only shared parameters, not {leaked}"
            )
