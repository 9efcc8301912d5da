"""The participant's release pipeline as a chain of small transforms (the shape of optax).

A transform is a pair of pure functions: ``init(global_params) -> state`` and
``update(release, state, ctx) -> (release, new_state)``. :func:`chain` composes them and
refuses an order that would weaken a guarantee: every transform has a stage, and stages
must appear in the order of :class:`Stage` (align before difference before clip before
noise before quantize before mask before bind). State is a value returned fresh by each
call, never a hidden attribute; the participant stores it between rounds, and exports it
with the rest of its state (:mod:`lensemble_flwr.release.state_codec` says what a state
may hold).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from lensemble_flwr.errors import ConfigError
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.protocol.state import GlobalState


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
    """What every transform may read about the round it releases into."""

    participant_id: str
    global_state: GlobalState
    round_seed: int
    dataset_root: str | None
    num_examples: int


@dataclasses.dataclass(frozen=True)
class Release:
    """What flows through the pipeline.

    ``local`` holds the participant's trained shared weights until the difference stage
    turns them into ``delta``; ``bound_root`` is set by the bind stage; ``applied`` names
    the transforms applied so far, in order.
    """

    local: NamedArrays | None = None
    delta: NamedArrays | None = None
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
    """

    name: str
    stage: Stage
    init: Callable[[Mapping[str, np.ndarray]], Any]
    update: Callable[[Release, Any, ReleaseContext], tuple[Release, Any]]
    parts: tuple[ReleaseTransform, ...] = ()


class ChainState(NamedTuple):
    states: tuple[Any, ...]


def chain(*transforms: ReleaseTransform) -> ReleaseTransform:
    """Compose transforms left to right.

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
            release = release.replace(applied=(*release.applied, transform.name))
            new_states.append(sub)
        return release, ChainState(tuple(new_states))

    name = "chain(" + ",".join(t.name for t in transforms) + ")"
    return ReleaseTransform(name, max(stages, default=Stage.ALIGN), init, update, transforms)
