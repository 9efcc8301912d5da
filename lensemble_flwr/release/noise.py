"""The noise stage: charge the participant's budget, then add the noise it paid for.

Two mechanisms, one stage each, both at ``Stage.NOISE`` (after clip, so noise is always
calibrated to a bounded update):

* :func:`gaussian_noise` (local DP) adds N(0, (σ·C)²) to every coordinate, from a CSPRNG;
* :func:`distributed_noise` (``dp-mode = "distributed"``) draws this member's discrete
  Gaussian share of a masked round's noise, on the masks' integer grid, sized by
  :func:`~lensemble_flwr.privacy.distributed.distributed_noise_for`; the mask stage adds
  it to the encoded values (the grid exists only there), and refuses to mask a release
  that carries no share.

Both charge first: :meth:`~lensemble_flwr.privacy.budget.PrivacyBudget.charge` refuses,
with :class:`~lensemble_flwr.errors.PrivacyBudgetExceeded`, a release that would exceed
the budget, and writes the charge to the participant's budget file before anything is
released. The stage's state is the charge (:class:`~.accounting.PrivacyState`): read
from the budget when the chain starts, the budget's state after the charge afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np

from lensemble_flwr.errors import RoundError
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.privacy.budget import PrivacyBudget, noise_stage_name
from lensemble_flwr.privacy.discrete_gaussian import secure_discrete_gaussian
from lensemble_flwr.privacy.distributed import (
    DISTRIBUTED_NOISE,
    DistributedNoise,
    distributed_noise_for,
)
from lensemble_flwr.privacy.gaussian import secure_normal
from lensemble_flwr.release.accounting import PrivacyState, check_restored
from lensemble_flwr.release.pipeline import Release, ReleaseContext, ReleaseTransform, Stage


def _check_noise(noise_multiplier: float, clip_norm: float) -> None:
    if not noise_multiplier > 0:
        raise ValueError("noise_multiplier must be positive")
    if not (clip_norm > 0 and math.isfinite(clip_norm)):
        raise ValueError("noise needs a positive, finite clip_norm")


def _clipped(release: Release, stage: str) -> NamedArrays:
    if release.delta is None or "clipped_norm" not in release.metadata:
        raise RoundError(f"{stage}: only a clipped delta can be noised")
    return release.delta


def _transform(
    name: str,
    budget: PrivacyBudget,
    update: Callable[[Release, PrivacyState, ReleaseContext], tuple[Release, PrivacyState]],
) -> ReleaseTransform:
    """A noise stage whose state is the budget's charge (checked when restored)."""

    def init(_params: Mapping[str, np.ndarray]) -> PrivacyState:
        return PrivacyState.of(budget)

    return ReleaseTransform(
        name, Stage.NOISE, init, update, load_state=lambda state: check_restored(state, budget)
    )


def _held(state: PrivacyState | None) -> tuple[int, float] | None:
    """(releases, epsilon) the stage last charged, which its budget file must still hold."""
    if state is None:
        return None
    return sum(steps for _, _, steps in state.history), state.epsilon


def _charged(budget: PrivacyBudget, epsilon: float) -> PrivacyState:
    """The stage's new state: the budget's history after the charge it just wrote."""
    history = tuple((float(s), float(q), int(n)) for s, q, n in budget.history)
    return PrivacyState(budget.mechanism, budget.adjacency, history, epsilon)


def gaussian_noise(
    noise_multiplier: float, clip_norm: float, budget: PrivacyBudget
) -> ReleaseTransform:
    """Charge ``budget`` for one release, then add N(0, (noise_multiplier·clip_norm)²).

    Raises:
        ValueError: no noise, or no finite clip norm to calibrate it to.
    """
    _check_noise(noise_multiplier, clip_norm)
    std = noise_multiplier * clip_norm

    def update(
        release: Release, state: PrivacyState, ctx: ReleaseContext
    ) -> tuple[Release, PrivacyState]:
        delta = _clipped(release, "gaussian_noise")
        # raises before anything is released (also if the file lost what ``state`` charged)
        epsilon = budget.charge(noise_multiplier, at_least=_held(state))
        noisy = {
            n: (a.astype(np.float64) + secure_normal(a.shape, std)).astype(a.dtype)
            for n, a in delta.items()
        }
        meta = {**release.metadata, "epsilon": epsilon, "noise_std": std}
        return release.replace(delta=noisy, metadata=meta), _charged(budget, epsilon)

    return _transform(noise_stage_name("gaussian_noise", budget.adjacency), budget, update)


def draw_noise_share(delta: NamedArrays, share: DistributedNoise) -> NamedArrays:
    """One member's discrete Gaussian share for every array of ``delta`` (grid units,
    int64), drawn in sorted order from a CSPRNG."""
    return {n: secure_discrete_gaussian(delta[n].shape, share.share_sigma) for n in sorted(delta)}


def distributed_noise(
    noise_multiplier: float,
    clip_norm: float,
    *,
    fraction_bits: int,
    threshold: int,
    budget: PrivacyBudget,
) -> ReleaseTransform:
    """Charge ``budget`` for this member's share of a masked round's distributed noise,
    and draw the share.

    The charge is the mechanism on the revealed sum of ``threshold`` shares (its
    equivalent Gaussian), made before anything is released; the stage's name is what the
    coordinator requires of a distributed-noise federation's updates. The delta's floats
    pass unchanged: the share (``release.noise_share``) is integer noise for the masks'
    grid at 2**``fraction_bits``, which the mask stage adds after the encoding.

    Raises:
        ValueError: no noise, or no finite clip norm to calibrate it to.
    """
    _check_noise(noise_multiplier, clip_norm)

    def update(
        release: Release, state: PrivacyState, ctx: ReleaseContext
    ) -> tuple[Release, PrivacyState]:
        delta = _clipped(release, "distributed_noise")
        dim = sum(int(a.size) for a in delta.values())
        share = distributed_noise_for(
            noise_multiplier, clip_norm, fraction_bits, threshold, dim, budget.adjacency
        )
        epsilon = budget.charge(
            share.equivalent_noise_multiplier, sensitivity_factor=1.0, at_least=_held(state)
        )
        meta = {
            **release.metadata,
            "epsilon": epsilon,
            "noise_std": share.sum_std,
            "noise_share_sigma": share.share_sigma,
        }
        drawn = draw_noise_share(delta, share)
        return release.replace(noise_share=drawn, metadata=meta), _charged(budget, epsilon)

    return _transform(noise_stage_name(DISTRIBUTED_NOISE, budget.adjacency), budget, update)
