"""What the secure-aggregation tests share: the Update a member sends with its masked
release."""

from __future__ import annotations

from typing import Any

from lensemble_flwr.protocol.messages import Update
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
