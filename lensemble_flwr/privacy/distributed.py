"""What one member's share of distributed noise is, and what it is charged.

With ``dp-mode = "distributed"`` the noise of a masked round is split between its
members: each adds a discrete Gaussian share in the integer domain of the masks
(:mod:`.discrete_gaussian`), and only the sum, which carries every surviving share, is
revealed. A share is sized so that the sum of ``secagg-threshold`` of them protects a
participant at least as well as one continuous Gaussian of std ``noise-multiplier`` × C on
the sum would: the revealed sum of t survivors has noise std ≈ σ·C (in value units), and
more survivors only add noise.

The release chain's noise stage (``release.noise.distributed_noise``) charges each
participant's budget with this mechanism before anything leaves and draws the share, sized
by :func:`distributed_noise_for`; the chain's mask stage (``release.masking``) adds that
share after the fixed-point encoding, so the share that is added is the share that was
charged.

Whom it protects, and under what assumption: against the coordinator (which sees masked
inputs and the noised sum only), against the other participants and against whoever
receives the models, provided at least ``threshold`` honest members' shares are in the
sum — an honest-but-curious coordinator, and members who do not subtract their own share.
No amplification by sampling is claimed: the coordinator knows who was sampled, and the
ledger records the invited set, so anyone who reads it does too.
"""

from __future__ import annotations

import dataclasses
import functools

from lensemble_flwr.privacy.budget import sensitivity_factor
from lensemble_flwr.privacy.discrete_gaussian import (
    ddg_sum_rho,
    equivalent_noise_multiplier,
    grid_l2_sensitivity,
    share_sigma,
)

MECHANISM = "distributed-discrete-gaussian"
"""The name of the mechanism, as the ledger records it."""
DISTRIBUTED_NOISE = "distributed_noise"
"""The release stage that charges a member's share (its name in an update's transforms)."""


@dataclasses.dataclass(frozen=True)
class DistributedNoise:
    """One member's noise share in a masked round and what it guarantees.

    Attributes:
        share_sigma: std of the member's discrete Gaussian share, in grid units.
        sensitivity: L2 sensitivity of one member's encoded update (grid units).
        rho: the zCDP ρ of the sum of ``threshold`` shares.
        equivalent_noise_multiplier: the Gaussian (sensitivity 1, no sampling) with the
            same Rényi curve: what the participant's budget is charged.
        threshold: the fewest shares the revealed sum carries.
        dim: coordinates per update.
        scale: the fixed-point factor (2**fraction_bits).
    """

    share_sigma: float
    sensitivity: float
    rho: float
    equivalent_noise_multiplier: float
    threshold: int
    dim: int
    scale: float

    @property
    def sum_std(self) -> float:
        """Std of the noise in the revealed sum of ``threshold`` shares, in value units."""
        return self.share_sigma * self.threshold**0.5 / self.scale


@functools.lru_cache(maxsize=64)
def distributed_noise_for(
    noise_multiplier: float,
    clip_norm: float,
    fraction_bits: int,
    threshold: int,
    dim: int,
    adjacency: str = "substitution",
) -> DistributedNoise:
    """The share that makes ``threshold`` of them a noise multiplier ``noise_multiplier``
    on a sum of updates clipped to ``clip_norm`` and encoded at 2**``fraction_bits``.

    The target is the local mechanism's: noise std σ·C against a sensitivity of 2C
    (substitution of a participant's dataset), i.e. a Gaussian of multiplier σ/2 relative
    to the sensitivity, which on the grid also covers the rounding of the encoding. Under
    ``adjacency = "zero-out"`` the sensitivity is C and the multiplier σ: the same σ·C in
    the sum, charged as a mechanism half as sensitive.

    Raises:
        ValueError: a parameter out of range (no noise, no clip, no threshold).
    """
    if not (noise_multiplier > 0 and clip_norm > 0 and threshold >= 1 and dim >= 1):
        raise ValueError("distributed noise needs noise, a clip, a threshold and a dimension")
    scale = float(2**fraction_bits)
    factor = sensitivity_factor(adjacency)
    sensitivity = grid_l2_sensitivity(clip_norm, scale, dim, sensitivity_factor=factor)
    sigma = share_sigma(noise_multiplier / factor, sensitivity, threshold, dim)
    rho = ddg_sum_rho(sensitivity, sigma, threshold, dim)
    return DistributedNoise(
        share_sigma=sigma,
        sensitivity=sensitivity,
        rho=rho,
        equivalent_noise_multiplier=equivalent_noise_multiplier(rho),
        threshold=threshold,
        dim=dim,
        scale=scale,
    )
