"""The clip stage: scale the update so that its global L2 norm is at most C.

The chain puts it before the noise stage, so noise is always calibrated to a bounded
update. The bound is checked after rounding to the release dtype (INV-DP-BOUND).
"""

from __future__ import annotations

import math
from typing import Any

from lensemble_flwr.errors import DPBoundViolation, RoundError
from lensemble_flwr.norms import l2_norm
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.release.pipeline import (
    Release,
    ReleaseContext,
    ReleaseTransform,
    Stage,
    no_state,
)

_SHRINK = 1.0 - 2.0**-20
"""Scale just below C/‖Δ‖, so that rounding to float32 cannot push the norm past C."""


def check_clip_bound(delta: NamedArrays, clip_norm: float) -> float:
    """The norm of ``delta``; DPBoundViolation if it exceeds ``clip_norm`` (INV-DP-BOUND)."""
    norm = l2_norm(delta)
    if not norm <= clip_norm:
        raise DPBoundViolation(f"post-clip norm {norm!r} exceeds the clip norm {clip_norm!r}")
    return norm


def clip(clip_norm: float) -> ReleaseTransform:
    """Scale the delta to global L2 norm at most ``clip_norm`` (``inf``: never scaled,
    only measured).

    Raises:
        ValueError: ``clip_norm`` is not positive (or is NaN).
    """
    if not (clip_norm > 0 and not math.isnan(clip_norm)):
        raise ValueError("clip_norm must be positive")

    def update(release: Release, state: Any, ctx: ReleaseContext) -> tuple[Release, Any]:
        if release.delta is None:
            raise RoundError("clip: no delta to clip")
        norm = l2_norm(release.delta)
        delta = release.delta
        if norm > clip_norm:
            scale = clip_norm / norm * _SHRINK
            delta = {n: (a * scale).astype(a.dtype) for n, a in delta.items()}
        clipped = check_clip_bound(delta, clip_norm)
        meta = {**release.metadata, "pre_clip_norm": norm, "clipped_norm": clipped}
        return release.replace(delta=delta, metadata=meta), state

    return ReleaseTransform("clip", Stage.CLIP, no_state, update)
