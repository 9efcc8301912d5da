"""What the secure-aggregation tests share: the Update a member sends with its masked
release, and a member's masking of a release through the release chain's mask stage."""

from __future__ import annotations

from typing import Any

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import LensembleError, SecureAggregationError
from lensemble_flwr.protocol.messages import RoundOpen, Update
from lensemble_flwr.protocol.state import GlobalState, PseudoGradient
from lensemble_flwr.release import Release, ReleaseContext, mask
from lensemble_flwr.secagg.participant_role import MaskingRole
from lensemble_flwr.secagg.protocol import MaskedRelease


def update_of(pid: str, release: MaskedRelease, **changes: Any) -> Update:
    """Member ``pid``'s masked Update of round 1 of run "run", carrying ``release`` (its
    masked values and sealed shares); ``changes`` override any field."""
    fields: dict[str, Any] = dict(
        run_id="run",
        round=1,
        sender=pid,
        participant_id=pid,
        dataset_root=None,
        delta=release.masked,
        num_examples=1,
        masked=True,
        sealed_shares={h: c.hex() for h, c in release.sealed.items()},
    )
    fields.update(changes)
    return Update(**fields)


def mask_release(
    role: MaskingRole, released: PseudoGradient, opened: RoundOpen, config: LensembleConfig
) -> dict[str, Any]:
    """The masked Update's fields for ``released``, made as a participant makes them: its
    masking role opens the round (checks, takes the listed key), the release chain's mask
    stage masks, and a release the stage refuses puts the role back as it was."""
    mask_round = role.open_round(opened, config)
    if mask_round is None:
        raise SecureAggregationError(f"{role.participant_id} is not a member of the round")
    meta = {"scales": released.scales} if released.scales else {}
    ctx = ReleaseContext(
        participant_id=role.participant_id,
        global_state=GlobalState.create(0, released.delta, sketch_seed=0, h_steps=1),
        round_seed=0,
        dataset_root=None,
        num_examples=released.num_examples,
        mask_round=mask_round,
    )
    try:
        out, _ = mask(config).update(Release(delta=released.delta, metadata=meta), None, ctx)
    except LensembleError:
        role.restore(mask_round.before)
        raise
    return {
        "delta": out.delta,
        "masked": out.masked,
        "scales": None,
        "sealed_shares": out.metadata["sealed_shares"],
        "next_mask_key": out.metadata["next_mask_key"],
    }
