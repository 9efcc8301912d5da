"""The difference stage: trained local weights become Δ = local − global."""

from __future__ import annotations

from typing import Any

from lensemble_flwr.errors import RoundError
from lensemble_flwr.params import subtract
from lensemble_flwr.release.pipeline import (
    Release,
    ReleaseContext,
    ReleaseTransform,
    Stage,
    no_state,
)


def difference() -> ReleaseTransform:
    """Δ = local − global, name by name (float32); ``local`` is dropped afterwards."""

    def update(release: Release, state: Any, ctx: ReleaseContext) -> tuple[Release, Any]:
        if release.local is None:
            raise RoundError("difference: no local weights to difference")
        delta = subtract(release.local, ctx.global_state.params)
        return release.replace(local=None, delta=delta), state

    return ReleaseTransform("difference", Stage.DIFFERENCE, no_state, update)
