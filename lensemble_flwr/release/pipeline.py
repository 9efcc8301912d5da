"""The participant's release as a chain of small transforms (the shape of optax).

A transform is a pair of pure functions: ``init(global_params) -> state`` and
``update(release, state, ctx) -> (release, new_state)``. :func:`chain` composes them and
refuses an order that would weaken a guarantee: every transform has a stage, and stages
must appear in the order of :class:`Stage` (align before difference before clip before
noise before quantize before mask before bind). The chain is the whole release: what it
returns is what leaves the participant (masked, in a masked round).

State is a value returned fresh by each call, never a hidden attribute; the participant
keeps it between rounds and exports it with the rest of its state
(:mod:`lensemble_flwr.release.state_codec` says what a state may hold). The noise stage's
state is the privacy charge (:class:`~lensemble_flwr.release.accounting.PrivacyState`).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from lensemble_flwr.errors import ConfigError
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.protocol.state import GlobalState

if TYPE_CHECKING:  # the mask stage's input; only a masked release imports secagg
    from lensemble_flwr.secagg.participant_role import MaskRound


class Stage(enum.IntEnum):
    """Where a transform sits in the release order."""

    ALIGN = 10
    DIFFERENCE = 20
    CLIP = 30
    NOISE = 40
    QUANTIZE = 50
    MASK = 60
    BIND = 70


@dataclasses.dataclass(frozen=True)
class ReleaseContext:
    """What every transform may read about the round it releases into.

    ``mask_round`` is the masked round attempt this release goes into (its members, its
    context and this participant's keys for it), the mask stage's input; None for a
    plaintext round.
    """

    participant_id: str
    global_state: GlobalState
    round_seed: int
    dataset_root: str | None
    num_examples: int
    mask_round: MaskRound | None = None


@dataclasses.dataclass(frozen=True)
class Release:
    """What flows through the pipeline.

    ``local`` holds the participant's trained shared weights until the difference stage
    turns them into ``delta``; ``noise_share`` is this member's share of distributed noise
    (integers on the masks' grid), drawn by the noise stage and added by the mask stage to
    the encoded values; ``masked`` is set by the mask stage (``delta`` then holds the
    masked integers); ``bound_root`` is set by the bind stage; ``applied`` names the
    transforms applied so far, in order (the mask stage is not named: the sum undoes it).
    """

    local: NamedArrays | None = None
    delta: NamedArrays | None = None
    noise_share: NamedArrays | None = None
    masked: bool = False
    bound_root: str | None = None
    applied: tuple[str, ...] = ()
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def replace(self, **changes: Any) -> Release:
        """A copy with ``changes`` applied (releases are immutable)."""
        return dataclasses.replace(self, **changes)


def no_state(_params: Mapping[str, np.ndarray]) -> None:
    """The ``init`` of a transform that keeps no state between rounds."""
    return None


class ReleaseTransform(NamedTuple):
    """A named, staged pair of pure functions.

    ``parts`` is set by :func:`chain` only: the transforms it composes, whose states are
    the entries of its :class:`ChainState`, in order (so that a saved state can name the
    stage each entry belongs to; see :mod:`lensemble_flwr.release.state_codec`).
    ``load_state`` checks a state restored from an export before it is used (it returns
    the state, or raises :class:`~lensemble_flwr.errors.RoundError`); None accepts any.
    """

    name: str
    stage: Stage
    init: Callable[[Mapping[str, np.ndarray]], Any]
    update: Callable[[Release, Any, ReleaseContext], tuple[Release, Any]]
    parts: tuple[ReleaseTransform, ...] = ()
    load_state: Callable[[Any], Any] | None = None


class ChainState(NamedTuple):
    """The state of a chain: one entry per composed transform, in order."""

    states: tuple[Any, ...]


def chain(*transforms: ReleaseTransform) -> ReleaseTransform:
    """Compose transforms left to right (every stage's name is recorded in the
    release's ``applied``, but a mask stage's).

    Raises:
        ConfigError: the stages are out of order or repeated (e.g. noise before clip).
    """
    stages = [t.stage for t in transforms]
    for before, after in itertools.pairwise(transforms):
        if after.stage <= before.stage:
            raise ConfigError(
                "release pipeline",
                f"{after.name!r} ({after.stage.name}) cannot follow {before.name!r} "
                f"({before.stage.name}); the order is {' -> '.join(s.name for s in Stage)}",
            )

    def init(params: Mapping[str, np.ndarray]) -> ChainState:
        return ChainState(tuple(t.init(params) for t in transforms))

    def update(
        release: Release, state: ChainState, ctx: ReleaseContext
    ) -> tuple[Release, ChainState]:
        new_states = []
        for transform, sub in zip(transforms, state.states, strict=True):
            release, sub = transform.update(release, sub, ctx)
            if transform.stage is not Stage.MASK:  # masking is undone by the sum it joins
                release = release.replace(applied=(*release.applied, transform.name))
            new_states.append(sub)
        return release, ChainState(tuple(new_states))

    name = "chain(" + ",".join(t.name for t in transforms) + ")"
    return ReleaseTransform(name, max(stages, default=Stage.ALIGN), init, update, transforms)
