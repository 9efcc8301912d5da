"""The bind stage: the release carries the participant's dataset commitment.

``bind`` attaches the participant's dataset Merkle root; the coordinator refuses an
update whose root differs from its sender's commitment.
"""

from __future__ import annotations

from typing import Any

from lensemble_flwr.errors import RoundError
from lensemble_flwr.release.pipeline import (
    Release,
    ReleaseContext,
    ReleaseTransform,
    Stage,
    no_state,
)


def bind() -> ReleaseTransform:
    """Bind the release to the participant's dataset commitment (one root per release)."""

    def update(release: Release, state: Any, ctx: ReleaseContext) -> tuple[Release, Any]:
        if release.delta is None or release.local is not None:
            raise RoundError("bind: only a differenced delta can be bound")
        if release.bound_root is not None:
            raise RoundError("bind: release is already bound")
        if ctx.dataset_root is None:
            raise RoundError("bind: this participant has no dataset commitment to bind to")
        return release.replace(bound_root=ctx.dataset_root), state

    return ReleaseTransform("bind", Stage.BIND, no_state, update)
