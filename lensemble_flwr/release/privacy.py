"""Release stages of differential privacy: clip the update, then add Gaussian noise.

The chain enforces the order (CLIP before NOISE), so noise is always calibrated to a
bounded update. ``clip`` scales Δ so that its global L2 norm over the shared groups is
at most ``clip_norm`` and checks the bound after rounding to the release dtype.
``gaussian_noise`` first charges the participant's budget (which refuses, with
:class:`PrivacyBudgetExceeded`, a release that would exceed it), then adds noise of
standard deviation ``noise_multiplier * clip_norm`` from a CSPRNG.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from lensemble_flwr.errors import DPBoundViolation, RoundError
from lensemble_flwr.norms import l2_norm
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.privacy.budget import PrivacyBudget, noise_stage_name
from lensemble_flwr.privacy.distributed import DISTRIBUTED_NOISE, distributed_noise_for
from lensemble_flwr.privacy.gaussian import secure_normal
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
    """Scale the delta to global L2 norm at most ``clip_norm``."""
    if not (clip_norm > 0 and math.isfinite(clip_norm)):
        raise ValueError("clip_norm must be positive and finite")

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


def gaussian_noise(
    noise_multiplier: float, clip_norm: float, budget: PrivacyBudget
) -> ReleaseTransform:
    """Charge ``budget`` for one release, then add N(0, (noise_multiplier·clip_norm)²)."""
    if not noise_multiplier > 0:
        raise ValueError("noise_multiplier must be positive")
    std = noise_multiplier * clip_norm

    def update(release: Release, state: Any, ctx: ReleaseContext) -> tuple[Release, Any]:
        if release.delta is None or "clipped_norm" not in release.metadata:
            raise RoundError("gaussian_noise: only a clipped delta can be noised")
        epsilon = budget.charge(noise_multiplier)  # raises before anything is released
        noisy = {
            n: (a.astype(np.float64) + secure_normal(a.shape, std)).astype(a.dtype)
            for n, a in release.delta.items()
        }
        meta = {**release.metadata, "epsilon": epsilon, "noise_std": std}
        return release.replace(delta=noisy, metadata=meta), state

    name = noise_stage_name("gaussian_noise", budget.adjacency)
    return ReleaseTransform(name, Stage.NOISE, no_state, update)


def distributed_noise(
    noise_multiplier: float,
    clip_norm: float,
    *,
    fraction_bits: int,
    threshold: int,
    budget: PrivacyBudget,
) -> ReleaseTransform:
    """Charge ``budget`` for this member's share of a masked round's distributed noise.

    The delta passes unchanged: the share is integer noise, added by the masking role
    after the fixed-point encoding (``secagg.participant_role``), sized by the same
    :func:`~lensemble_flwr.privacy.distributed.distributed_noise_for`. The charge is the
    mechanism on the revealed sum of ``threshold`` shares (its equivalent Gaussian), made
    before anything is released; the stage's name is what the coordinator requires of a
    distributed-noise federation's updates.
    """
    if not noise_multiplier > 0:
        raise ValueError("noise_multiplier must be positive")

    def update(release: Release, state: Any, ctx: ReleaseContext) -> tuple[Release, Any]:
        if release.delta is None or "clipped_norm" not in release.metadata:
            raise RoundError("distributed_noise: only a clipped delta can be noised")
        dim = sum(int(a.size) for a in release.delta.values())
        share = distributed_noise_for(
            noise_multiplier, clip_norm, fraction_bits, threshold, dim, budget.adjacency
        )
        epsilon = budget.charge(share.equivalent_noise_multiplier, sensitivity_factor=1.0)
        meta = {
            **release.metadata,
            "epsilon": epsilon,
            "noise_std": share.sum_std,
            "noise_share_sigma": share.share_sigma,
        }
        return release.replace(metadata=meta), state

    name = noise_stage_name(DISTRIBUTED_NOISE, budget.adjacency)
    return ReleaseTransform(name, Stage.NOISE, no_state, update)
