"""The coordinator's record of who may take part in masked rounds.

A participant may be a member once it is bound with both public keys and its mask key
was never revealed. When a member drops out of a round, its mask key is reconstructed to
unmask around it: it is *compromised* until it commits new keys. The coordinator also
keeps, per participant, the mask-key shares it sealed for a member set (they are used
only if it drops out of a later round with the same set).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lensemble_flwr.errors import RoundError
from lensemble_flwr.protocol.messages import Commitment
from lensemble_flwr.secagg.protocol import Member, members_digest


class Membership:
    """Keys, compromised members, and stored mask-key shares, across rounds."""

    def __init__(self) -> None:
        self.compromised: set[str] = set()
        self._shares: dict[str, tuple[str, dict[str, bytes]]] = {}  # pid -> (set, shares)

    def keyed(self, commitment: Commitment | None) -> bool:
        """Bound, with keys that were never revealed: may be a member of a masked round."""
        return (
            commitment is not None
            and bool(commitment.mask_key and commitment.enc_key)
            and commitment.participant_id not in self.compromised
        )

    @staticmethod
    def members(pids: Iterable[str], commitments: Mapping[str, Commitment]) -> list[Member]:
        """The Members (ids and public keys) of ``pids``, sorted."""
        return [
            Member(
                p,
                bytes.fromhex(str(commitments[p].mask_key)),
                bytes.fromhex(str(commitments[p].enc_key)),
            )
            for p in sorted(pids)
        ]

    def shares_for(self, members: list[Member]) -> dict[str, dict[str, bytes]]:
        """The stored mask-key shares that were sealed for exactly this member set."""
        digest = members_digest(members)
        return {p: shares for p, (d, shares) in self._shares.items() if d == digest}

    def store_shares(
        self, pid: str, members: list[Member], sealed_hex: Mapping[str, str]
    ) -> dict[str, bytes]:
        """Keep ``pid``'s mask-key shares for ``members``; returns them as bytes.

        Raises:
            RoundError: a share is not hex (nothing is kept).
        """
        try:
            shares = {holder: bytes.fromhex(c) for holder, c in sealed_hex.items()}
        except (ValueError, TypeError):
            raise RoundError(f"{pid}: mask-key shares are not hex") from None
        self._shares[pid] = (members_digest(members), shares)
        return shares

    def rebound(self, prior: Commitment | None, commitment: Commitment) -> None:
        """A new commitment: new keys end a compromise (and void the old shares)."""
        if prior is not None and commitment.mask_key and commitment.mask_key != prior.mask_key:
            self.compromised.discard(commitment.participant_id)
            self._shares.pop(commitment.participant_id, None)

    def revealed(self, pids: Iterable[str]) -> None:
        """These members' mask keys were reconstructed: they must rotate them."""
        self.compromised.update(pids)

    def snapshot(self) -> dict[str, Any]:
        """The compromised members, JSON-compatible (for the coordinator's durable state;
        the stored shares are kept one participant at a time: :meth:`shares_snapshot`)."""
        return {"compromised": sorted(self.compromised)}

    def shares_snapshot(self, pid: str) -> dict[str, Any]:
        """``pid``'s stored mask-key shares, JSON-compatible (none: an empty mapping)."""
        if pid not in self._shares:
            return {}
        digest, sealed = self._shares[pid]
        return {"members": digest, "sealed": {h: c.hex() for h, c in sorted(sealed.items())}}

    def stored_shares(self) -> dict[str, dict[str, Any]]:
        """Every participant's stored mask-key shares, as :meth:`shares_snapshot` gives
        them (participants with none are left out): two records that keep the same
        shares compare equal."""
        return {pid: self.shares_snapshot(pid) for pid in sorted(self._shares)}

    @classmethod
    def restore(
        cls, snapshot: Mapping[str, Any], shares: Mapping[str, Mapping[str, Any]] = {}
    ) -> Membership:
        """The record :meth:`snapshot` and :meth:`shares_snapshot` were taken of.

        Raises:
            ValueError, TypeError, KeyError: a snapshot is malformed.
        """
        restored = cls()
        restored.compromised = {str(p) for p in snapshot["compromised"]}
        for pid, entry in shares.items():
            if entry:
                sealed = {str(h): bytes.fromhex(c) for h, c in entry["sealed"].items()}
                restored._shares[str(pid)] = (str(entry["members"]), sealed)
        return restored
