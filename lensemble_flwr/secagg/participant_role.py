"""A participant's part in masked rounds: keys, masking its release, disclosing shares.

The participant turns its release into the fixed-point integers the plaintext aggregator
would add (``to_fixed_point``), masks them, and seals a share of its fresh self mask for
every member; when the member set is new to it, it also seals shares of its mask key.
Its keys persist with its state; when the coordinator says its mask key was revealed
(because it dropped out of a round), it rotates them.
"""

from __future__ import annotations

from typing import Any

from lensemble_flwr.aggregation.fixed_point import to_fixed_point
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import RoundError, SecureAggregationError
from lensemble_flwr.protocol.messages import RoundOpen, UnmaskRequest, released_max_abs
from lensemble_flwr.protocol.state import PseudoGradient
from lensemble_flwr.secagg.keys import SecAggKeys
from lensemble_flwr.secagg.protocol import (
    Member,
    context_of,
    disclose,
    mask,
    members_digest,
    share_mask_key,
)


def parse_members(encoded: tuple[str, ...]) -> list[Member]:
    """RoundOpen's ``pid:mask_key:enc_key`` strings as Members."""
    members = []
    for item in encoded:
        pid, mask_hex, enc_hex = item.rsplit(":", 2)
        members.append(Member(pid, bytes.fromhex(mask_hex), bytes.fromhex(enc_hex)))
    return members


def encode_member(member: Member) -> str:
    return f"{member.pid}:{member.mask_public.hex()}:{member.enc_public.hex()}"


class MaskingRole:
    """The masking state of one participant (what it must keep between messages)."""

    def __init__(self, participant_id: str) -> None:
        self.participant_id = participant_id
        self.keys: SecAggKeys | None = None
        self.shared_for: str | None = None  # member set its key shares were sealed for
        self.key_shares: dict[str, str] = {}  # the sealed shares sent for that set (hex)
        self.members: list[Member] = []
        self.context = b""
        self.degree = 0  # the round's neighbour graph (0: every other member)

    def keys_for_commitment(self, rotate: bool) -> dict[str, str]:
        if self.keys is None or rotate:
            self.keys = SecAggKeys.generate()
            self.shared_for = None
            self.key_shares = {}
        return {"mask_key": self.keys.mask_public.hex(), "enc_key": self.keys.enc_public.hex()}

    def is_member(self, msg: RoundOpen) -> bool:
        return any(m.split(":", 1)[0] == self.participant_id for m in msg.secagg_members)

    def mask_release(
        self, released: PseudoGradient, msg: RoundOpen, config: LensembleConfig
    ) -> dict[str, Any]:
        """The masked Update's fields for ``released``."""
        if self.keys is None:
            raise SecureAggregationError(f"{self.participant_id}: no keys for a masked round")
        if msg.secagg_neighbours != config.federation.secagg_neighbours:
            raise SecureAggregationError(
                f"{self.participant_id}: the round asks for a neighbour graph of degree "
                f"{msg.secagg_neighbours}, this participant agreed to "
                f"{config.federation.secagg_neighbours}"
            )
        members = parse_members(msg.secagg_members)
        agg = config.aggregation
        weight = config.federation.weight_of(released.num_examples)
        scales = released.scales or {}
        try:  # the same ingress check a plaintext update gets: finite, within bounds
            largest = released_max_abs(released.delta, released.scales)
        except ValueError as exc:
            raise RoundError(f"{self.participant_id}: {exc}; nothing is masked") from None
        if largest > agg.max_abs_update:
            raise RoundError(f"{self.participant_id}: release exceeds max-abs-update")
        unit = float(weight) * 2.0**agg.fraction_bits
        values = to_fixed_point(
            released.delta, {n: unit * scales.get(n, 1.0) for n in released.delta}
        )
        self.members = members
        self.context = context_of(msg.run_id, msg.round, msg.attempt)
        self.degree = msg.secagg_neighbours
        masked = mask(
            values,
            me=self.participant_id,
            keys=self.keys,
            members=members,
            threshold=msg.secagg_threshold,
            context=self.context,
            degree=self.degree,
        )
        fields: dict[str, Any] = {
            "delta": masked.masked,
            "masked": True,
            "scales": None,
            "sealed_shares": {h: c.hex() for h, c in masked.sealed.items()},
        }
        digest = members_digest(members)
        if digest != self.shared_for:
            shares = share_mask_key(
                self.keys,
                me=self.participant_id,
                members=members,
                threshold=msg.secagg_threshold,
                run_id=msg.run_id,
            )
            self.key_shares = {h: c.hex() for h, c in shares.items()}
            self.shared_for = digest
            fields["key_shares"] = self.key_shares
        elif msg.send_key_shares:  # the coordinator lost them (a restart): the same again
            fields["key_shares"] = self.key_shares
        return fields

    def disclose(self, request: UnmaskRequest) -> dict[str, dict[str, str]]:
        """The UnmaskResponse's share fields for ``request``."""
        if self.keys is None or not self.members:
            raise SecureAggregationError(f"{self.participant_id}: no masked round to unmask")
        if context_of(request.run_id, request.round, request.attempt) != self.context:
            raise SecureAggregationError(f"{self.participant_id}: unmask request for another round")
        survivors = set(request.survivors)
        shares = disclose(
            me=self.participant_id,
            keys=self.keys,
            members=self.members,
            run_id=request.run_id,
            context=self.context,
            survivors=request.survivors,
            dropped=request.dropped,
            self_mask_shares={
                s: bytes.fromhex(c) for s, c in request.sealed.items() if s in survivors
            },
            mask_key_shares={
                s: bytes.fromhex(c) for s, c in request.sealed.items() if s not in survivors
            },
            degree=self.degree,
        )
        return {
            "b_shares": {s: f"{x}:{y:x}" for s, (x, y) in shares["b"].items()},
            "m_shares": {s: f"{x}:{y:x}" for s, (x, y) in shares["m"].items()},
        }

    def export(self) -> dict[str, Any]:
        return {
            "keys": None
            if self.keys is None
            else [self.keys.mask_private.hex(), self.keys.enc_private.hex()],
            "shared_for": self.shared_for,
            "key_shares": self.key_shares,
            "members": [encode_member(m) for m in self.members],
            "context": self.context.decode(),
            "degree": self.degree,
        }

    def restore(self, meta: dict[str, Any]) -> None:
        keys = meta.get("keys")
        self.keys = SecAggKeys(bytes.fromhex(keys[0]), bytes.fromhex(keys[1])) if keys else None
        self.shared_for = meta.get("shared_for")
        self.key_shares = dict(meta.get("key_shares") or {})
        self.members = parse_members(tuple(meta.get("members", ())))
        self.context = str(meta.get("context", "")).encode()
        self.degree = int(meta.get("degree", 0))
