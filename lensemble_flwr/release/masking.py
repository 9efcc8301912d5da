"""The mask stage: the release becomes a masked round's integers, which only the sum
reveals.

The stage turns the release into the fixed-point integers the plaintext aggregator would
add for it (``to_fixed_point``: weight · 2**F, times the int8 scale if quantized), adds
this member's share of distributed noise when the noise stage drew one, and masks the
result with the round's keys (:func:`~lensemble_flwr.secagg.protocol.mask`), sealing a
share of its fresh self mask for every member (in a sparse graph, for each neighbour).
What it needs of the round comes as an explicit input, ``ctx.mask_round``
(:class:`~lensemble_flwr.secagg.participant_role.MaskRound`: members, context, keys),
which the participant's masking role opened before training. The masked sum the
coordinator reveals equals the plaintext sum of the same releases, bit for bit.
"""

from __future__ import annotations

from typing import Any

from lensemble_flwr.aggregation.fixed_point import to_fixed_point
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import RoundError
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.privacy.budget import noise_stage_name
from lensemble_flwr.privacy.calibration import ingress_bound
from lensemble_flwr.privacy.distributed import DISTRIBUTED_NOISE
from lensemble_flwr.protocol.messages import released_max_abs
from lensemble_flwr.release.pipeline import (
    Release,
    ReleaseContext,
    ReleaseTransform,
    Stage,
    no_state,
)
from lensemble_flwr.secagg import protocol
from lensemble_flwr.secagg.participant_role import MaskRound


def encode(release: Release, num_examples: int, config: LensembleConfig, me: str) -> NamedArrays:
    """The fixed-point integers of ``release``, after the ingress check a plaintext update
    gets (finite, within ``max-abs-update``).

    Raises:
        RoundError: the release has no delta, is not finite or exceeds ``max-abs-update``.
    """
    if release.delta is None or release.local is not None:
        raise RoundError(f"{me}: mask: only a differenced delta can be masked")
    scales = release.metadata.get("scales")
    try:
        largest = released_max_abs(release.delta, scales)
    except ValueError as exc:
        raise RoundError(f"{me}: {exc}; nothing is masked") from None
    if largest > ingress_bound(config):
        raise RoundError(f"{me}: release exceeds max-abs-update")
    unit = float(config.federation.weight_of(num_examples)) * 2.0**config.aggregation.fraction_bits
    factors = {n: unit * (scales or {}).get(n, 1.0) for n in release.delta}
    return to_fixed_point(release.delta, factors)


def with_noise_share(
    values: NamedArrays, release: Release, config: LensembleConfig, me: str
) -> NamedArrays:
    """``values`` plus the member's share of distributed noise that its noise stage drew
    and charged (under this federation's dp-adjacency).

    Raises:
        RoundError: the release carries no share, or was charged by no distributed noise
            stage of the federation's adjacency (nothing is masked).
    """
    charged = noise_stage_name(DISTRIBUTED_NOISE, config.privacy.dp_adjacency)
    share = release.noise_share
    if share is None or charged not in release.applied or set(share) != set(values):
        raise RoundError(
            f"{me}: distributed noise without its charged release stage (under this "
            "federation's dp-adjacency); nothing is masked"
        )
    return {name: values[name] + share[name] for name in sorted(values)}


def mask(config: LensembleConfig) -> ReleaseTransform:
    """Mask the release for ``ctx.mask_round`` (see the module docstring); the release's
    ``delta`` becomes the masked integers, ``metadata`` gains ``sealed_shares`` and
    ``next_mask_key``, and its ``scales`` (folded into the encoding) and noise share
    (added to it) are dropped.

    Raises (from the stage):
        RoundError: no masked round to mask for (a masked federation releases nothing in
            the clear), or what :func:`encode` and :func:`with_noise_share` refuse.
    """
    distributed = config.privacy.distributed

    def update(release: Release, state: Any, ctx: ReleaseContext) -> tuple[Release, Any]:
        opened: MaskRound | None = ctx.mask_round
        me = ctx.participant_id
        if opened is None or opened.participant_id != me:
            raise RoundError(f"{me}: mask: no masked round to mask for; nothing is released")
        values = encode(release, ctx.num_examples, config, me)
        if distributed:
            values = with_noise_share(values, release, config, me)
        masked = protocol.mask(
            values,
            me=me,
            keys=opened.keys,
            members=opened.members,
            threshold=opened.threshold,
            context=opened.context,
            degree=opened.degree,
        )
        meta = {k: v for k, v in release.metadata.items() if k != "scales"}
        meta["sealed_shares"] = {h: c.hex() for h, c in masked.sealed.items()}
        meta["next_mask_key"] = opened.next_mask_key
        out = release.replace(delta=masked.masked, noise_share=None, masked=True, metadata=meta)
        return out, state

    return ReleaseTransform("mask", Stage.MASK, no_state, update)
