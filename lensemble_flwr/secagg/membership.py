"""The coordinator's record of who may take part in masked rounds, and with which key.

A participant may be a member of a masked round when it is bound with a sealing key and
has announced a mask key that no round attempt listed yet. Mask keys serve one attempt:
the first comes with the participant's Commitment, each next one with its masked update.
Listing a member set *spends* its keys, whether or not the members then contribute; a
participant whose key was spent and who announced no other one commits a fresh key
before it can be a member again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lensemble_flwr.protocol.messages import Commitment
from lensemble_flwr.secagg.protocol import Member


class Membership:
    """The unspent mask key of each participant, across rounds."""

    def __init__(self) -> None:
        self.mask_keys: dict[str, str] = {}  # pid -> its announced, unspent mask key (hex)

    def keyed(self, commitment: Commitment | None) -> bool:
        """Bound with a sealing key and an unspent mask key: may be a member."""
        return (
            commitment is not None
            and bool(commitment.enc_key)
            and commitment.participant_id in self.mask_keys
        )

    def members(self, pids: Iterable[str], commitments: Mapping[str, Commitment]) -> list[Member]:
        """The Members (ids, unspent mask keys, sealing keys) of ``pids``, sorted; their
        mask keys are spent from now on."""
        members = [
            Member(p, bytes.fromhex(self.mask_keys[p]), bytes.fromhex(str(commitments[p].enc_key)))
            for p in sorted(pids)
        ]
        for member in members:
            del self.mask_keys[member.pid]
        return members

    def rebound(self, prior: Commitment | None, commitment: Commitment) -> None:
        """A commitment that brings a mask key other than the prior one announces it (a
        copy of the prior commitment announces nothing: its key may be spent)."""
        fresh = commitment.mask_key and (prior is None or commitment.mask_key != prior.mask_key)
        if fresh:
            self.mask_keys[commitment.participant_id] = str(commitment.mask_key)

    def announce(self, pid: str, mask_key: str) -> None:
        """``pid`` announced the mask key of its next round (with a masked update)."""
        self.mask_keys[pid] = mask_key

    def snapshot(self) -> dict[str, Any]:
        """The unspent mask keys, JSON-compatible (for the coordinator's durable state)."""
        return {"mask_keys": dict(sorted(self.mask_keys.items()))}

    @classmethod
    def restore(cls, snapshot: Mapping[str, Any]) -> Membership:
        """The record :meth:`snapshot` was taken of (a record without mask keys, e.g. of
        a run from before keys were per round, restores none: members commit again).

        Raises:
            ValueError, TypeError, AttributeError: a snapshot is malformed.
        """
        restored = cls()
        restored.mask_keys = {str(p): str(k) for p, k in snapshot.get("mask_keys", {}).items()}
        for key in restored.mask_keys.values():
            if len(bytes.fromhex(key)) != 32:
                raise ValueError("a mask key is not 32 bytes")
        return restored
