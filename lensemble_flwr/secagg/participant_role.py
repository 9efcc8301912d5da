"""A participant's part in masked rounds: its keys, the round it masks for, disclosing.

The role checks a round's member list against what the participant agreed to and hands
the release chain's mask stage (:mod:`lensemble_flwr.release.masking`) a
:class:`MaskRound`: the members, the round's context and the key agreements of the mask
key that serves this one round attempt. The stage masks; the role keeps what the
round's unmask request will need. With the masked update the participant announces the
public half of the key its next round will use; the private halves of announced keys
stay with the participant; a key is deleted once its round's unmask request is answered
(one answer per attempt). A role opens each round attempt once, and only attempts after
the last one it opened (a run's rounds and attempts only move forward): a second opening
of an attempt would let a coordinator ask again for what was answered in the first, with
the sealed shares of the first. When somebody dropped, the member first attests the survivor
set to the other survivors and discloses only for a set enough of them attested
(:mod:`~lensemble_flwr.secagg.consistency`). Its sealing key is long-lived: it only ever
encrypts shares for one peer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import SecureAggregationError
from lensemble_flwr.protocol.messages import (
    RoundOpen,
    SurvivorAttestation,
    SurvivorCheck,
    UnmaskRequest,
    UnmaskResponse,
)
from lensemble_flwr.secagg import consistency, prg
from lensemble_flwr.secagg.keys import BoxKeys, SecAggKeys, new_private_key, public_key
from lensemble_flwr.secagg.protocol import (
    Member,
    check_partition,
    context_of,
    disclose,
    graph_of,
)

ANNOUNCED_KEYS_KEPT = 4
"""How many announced, unused mask keys a participant keeps (the coordinator lists only
the newest one it received; older ones matter only while messages cross)."""


def parse_members(encoded: tuple[str, ...]) -> list[Member]:
    """RoundOpen's ``pid:mask_key:enc_key`` strings as Members. In a sparse graph the
    members that are not the recipient's neighbours come as ``pid::`` (named, for the
    ring and the partition, without their keys): Members with empty keys."""
    members = []
    for item in encoded:
        if item.endswith("::"):  # named only: nothing to decode
            members.append(Member(item[:-2], b"", b""))
            continue
        pid, mask_hex, enc_hex = item.rsplit(":", 2)
        members.append(Member(pid, bytes.fromhex(mask_hex), bytes.fromhex(enc_hex)))
    return members


def encode_member(member: Member) -> str:
    """A Member as RoundOpen's ``pid:mask_key:enc_key`` string (:func:`parse_members`)."""
    return f"{member.pid}:{member.mask_public.hex()}:{member.enc_public.hex()}"


def encode_named(member: Member) -> str:
    """A Member as RoundOpen names it without its keys: ``pid::`` (:func:`parse_members`)."""
    return f"{member.pid}::"


@dataclasses.dataclass(frozen=True, eq=False)
class MaskRound:
    """What the mask stage needs to mask one release into one round attempt.

    Attributes:
        participant_id: the masking participant.
        members: the round's members (named without keys where a sparse graph leaves
            them out of this participant's neighbourhood).
        context: the round attempt's context (run, round, attempt).
        threshold: the round's threshold t.
        degree: the round's neighbour graph (0: every other member).
        keys: the key agreements of the mask key the round lists for this participant.
        next_mask_key: the public half of the key announced with the masked update.
        before: the role's exported state before it opened the round (what
            :meth:`MaskingRole.restore` puts back when nothing is released).
    """

    participant_id: str
    members: tuple[Member, ...]
    context: bytes
    threshold: int
    degree: int
    keys: SecAggKeys
    next_mask_key: str
    before: dict[str, Any]


def _canonical(partition: Sequence[Sequence[str]]) -> list[list[str]]:
    """A partition (survivors, dropped) as the set it names: each part sorted, so that
    the same set listed in another order compares equal (what an attestation covers,
    :func:`~.consistency.survivor_set`)."""
    survivors, dropped = partition
    return [sorted(survivors), sorted(dropped)]


def _keyed(member: Member) -> bool:
    return len(member.mask_public) == 32 and len(member.enc_public) == 32


class MaskingRole:
    """The masking state of one participant (what it must keep between messages)."""

    def __init__(self, participant_id: str) -> None:
        self.participant_id = participant_id
        self.enc_private: bytes | None = None  # long-lived: seals shares for one peer
        self.announced: dict[str, bytes] = {}  # public hex -> private, announced, unused
        self.round_key: bytes | None = None  # the mask key of the attempt masked last
        self.answered: dict[str, Any] | None = None  # that attempt's unmask answer
        self.attested: dict[str, Any] | None = None  # that attempt's survivor attestation
        self.members: list[Member] = []
        self.context = b""
        self.degree = 0  # the round's neighbour graph (0: every other member)
        self.threshold = 0  # the round's threshold t (0: no round masked)
        self.opened: tuple[str, int, int] | None = None  # (run, round, attempt) opened last
        self._boxes: BoxKeys | None = None  # the sealing key's boxes (memory only)
        self._round_keys: SecAggKeys | None = None  # the round's agreements (memory only)
        self._members_read: tuple[tuple[str, ...] | None, list[Member]] = (None, [])

    def _announce(self) -> str:
        """A fresh mask key: keep its private half, return its public half (hex)."""
        private = new_private_key()
        public = public_key(private).hex()
        self.announced[public] = private
        while len(self.announced) > ANNOUNCED_KEYS_KEPT:
            del self.announced[next(iter(self.announced))]  # the oldest
        return public

    def keys_for_commitment(self) -> dict[str, str]:
        """The key fields of a Commitment: a fresh mask key, and the sealing key."""
        if self.enc_private is None:
            self.enc_private = new_private_key()
        return {"mask_key": self._announce(), "enc_key": public_key(self.enc_private).hex()}

    def _parsed(self, encoded: tuple[str, ...]) -> list[Member]:
        """:func:`parse_members`, once per member list (a round's list is checked before
        the participant trains and again when it masks)."""
        if self._members_read[0] is not encoded:
            self._members_read = (encoded, parse_members(encoded))
        return list(self._members_read[1])

    def is_member(self, msg: RoundOpen) -> bool:
        """Whether ``msg``'s member list names this participant."""
        return any(m.split(":", 1)[0] == self.participant_id for m in msg.secagg_members)

    def check_round(self, msg: RoundOpen, config: LensembleConfig) -> list[Member]:
        """Everything that must hold before this participant masks for ``msg``; returns
        the members.

        Raises:
            SecureAggregationError: no sealing key; another PRG than this version's, or
                another threshold or neighbour graph than agreed, or fewer members than
                the threshold; a member list that does not parse or names this
                participant with a mask key it never announced or already used, or with
                another sealing key; a member it deals a share to (every member; in a
                sparse graph, its neighbours) listed without keys; a round attempt of
                this run that is not after the last one this role opened
                (:meth:`_check_forward`).
        """
        me, fed = self.participant_id, config.federation
        if self.enc_private is None:
            raise SecureAggregationError(f"{me}: no keys for a masked round")
        if msg.secagg_neighbours != fed.secagg_neighbours:
            raise SecureAggregationError(
                f"{me}: the round asks for a neighbour graph of degree "
                f"{msg.secagg_neighbours}, this participant agreed to {fed.secagg_neighbours}"
            )
        if msg.secagg_prg != prg.PRG_ID:
            raise SecureAggregationError(
                f"{me}: the round masks with PRG {msg.secagg_prg or 'unnamed'!r} (a "
                f"coordinator of another version?), this participant with {prg.PRG_ID!r}: "
                "masks drawn with two PRGs do not cancel"
            )
        if msg.secagg_threshold != fed.secagg_threshold:
            raise SecureAggregationError(
                f"{me}: the round asks for threshold {msg.secagg_threshold}, this "
                f"participant agreed to {fed.secagg_threshold}"
            )
        try:
            members = self._parsed(msg.secagg_members)
        except ValueError as exc:
            raise SecureAggregationError(
                f"{me}: a member list that does not parse: {exc}"
            ) from None
        if len(members) < fed.secagg_threshold:
            raise SecureAggregationError(
                f"{me}: {len(members)} members, fewer than the threshold {fed.secagg_threshold}"
            )
        mine = [m for m in members if m.pid == me]
        listed = mine[0].mask_public.hex() if len(mine) == 1 else None
        if listed not in self.announced:
            raise SecureAggregationError(
                f"{me}: the round lists a mask key this participant does not hold (never "
                "announced, or already used): nothing is masked"
            )
        if mine[0].enc_public != public_key(self.enc_private):
            raise SecureAggregationError(f"{me}: the round lists another sealing key")
        if len({m.pid for m in members}) != len(members):
            raise SecureAggregationError(f"{me}: the round lists a member twice")
        context = context_of(msg.run_id, msg.round, msg.attempt)
        graph = graph_of(members, msg.secagg_neighbours, context)
        if graph.sparse:  # t_k = share_threshold(C, k, t), from the k and t checked above
            near = graph.near(me)
            dealt = [m for m in members if m.pid in near]
        else:
            dealt = members
        bare = [m.pid for m in dealt if not _keyed(m)]
        if bare:
            raise SecureAggregationError(
                f"{me}: the round lists members it deals a share to without their keys: {bare[:3]}"
            )
        self._check_forward(msg)
        return members

    def _check_forward(self, msg: RoundOpen) -> None:
        """``msg``'s round attempt must come after the last one this role opened in the
        same run (another run starts afresh). Opening one attempt twice would reset what
        the role answered for it, while the sealed self-mask shares of the first opening
        (bound to the attempt, not to the opening) still open: a coordinator could
        collect a member's pairwise seeds in the first and its self mask in the second.

        Raises:
            SecureAggregationError: the attempt was opened already, or an earlier one.
        """
        last = self.opened
        if last is None or last[0] != msg.run_id:
            return
        if (msg.round, msg.attempt) <= (last[1], last[2]):
            raise SecureAggregationError(
                f"{self.participant_id}: round {msg.round} attempt {msg.attempt} opened "
                f"after round {last[1]} attempt {last[2]} of the same run: an attempt is "
                "opened once, and a retry is a new attempt; nothing is masked"
            )

    def open_round(self, msg: RoundOpen, config: LensembleConfig) -> MaskRound | None:
        """The mask stage's inputs for ``msg`` (None when the round does not list this
        participant): everything is checked first (:meth:`check_round`), then the role
        moves to the round as if the release were masked — the key the round lists is
        taken (a key masks once), the round's members and context are kept for its unmask
        request, and the next key is announced. Called before training, so a round it
        refuses spends no privacy budget; a release that then fails puts the role back
        with :meth:`restore` of the returned ``before``.

        Raises:
            SecureAggregationError: see :meth:`check_round` (nothing changes).
        """
        if not self.is_member(msg):
            return None
        members = self.check_round(msg, config)
        before = self.export()
        listed = next(m for m in members if m.pid == self.participant_id).mask_public.hex()
        self.round_key = self.announced.pop(listed)
        self.members = members
        context = context_of(msg.run_id, msg.round, msg.attempt)
        if context != self.context:  # never forget an attempt's answers while in it
            self.answered = None
            self.attested = None
        self.context = context
        self.opened = (msg.run_id, msg.round, msg.attempt)
        self.degree = msg.secagg_neighbours
        self.threshold = msg.secagg_threshold
        return MaskRound(
            participant_id=self.participant_id,
            members=tuple(members),
            context=self.context,
            threshold=self.threshold,
            degree=self.degree,
            keys=self._keys(),
            next_mask_key=self._announce(),
            before=before,
        )

    def _keys(self) -> SecAggKeys:
        """The round's keys, the same object from masking to disclosing, so that every
        X25519 agreement is made once per peer: a pair seed with each neighbour (masking,
        and disclosing it for a dropped one), a box with each member (sealing a share for
        it, and opening its share); boxes are kept across rounds with the sealing key."""
        assert self.round_key is not None and self.enc_private is not None  # callers check
        if self._boxes is None or self._boxes.enc_private != self.enc_private:
            self._boxes = BoxKeys(self.enc_private)
        keys = self._round_keys
        if keys is None or keys.mask_private != self.round_key or keys.boxes is not self._boxes:
            keys = SecAggKeys(self.round_key, self.enc_private, boxes=self._boxes)
            self._round_keys = keys
        return keys

    def _partition_of(self, msg: UnmaskRequest | SurvivorCheck) -> list[list[str]]:
        """``msg``'s partition, once it is known to be about this member's masked round.

        Raises:
            SecureAggregationError: no masked round, or ``msg`` is of another one.
        """
        me = self.participant_id
        if not self.members:
            raise SecureAggregationError(f"{me}: no masked round to unmask")
        if context_of(msg.run_id, msg.round, msg.attempt) != self.context:
            raise SecureAggregationError(f"{me}: unmask request for another round")
        return _canonical([msg.survivors, msg.dropped])

    def _check_partition(self, survivors: tuple[str, ...], dropped: tuple[str, ...]) -> None:
        check_partition(
            me=self.participant_id, members=self.members, context=self.context,
            survivors=survivors, dropped=dropped, threshold=self.threshold, degree=self.degree,
        )  # fmt: skip

    def attest(self, check: SurvivorCheck) -> dict[str, str]:
        """The SurvivorAttestation's tags for ``check``: this member's attestation of the
        survivor set to each of its surviving neighbours. A member attests one survivor
        set per attempt, and then discloses for that set only: the same check again gets
        the same answer, another set is refused, and so is a set other than the one it
        already disclosed for.

        Raises:
            SecureAggregationError: no masked round to attest, another round, another
                partition than the one attested or answered, a disclosure already made
                (the round's key is gone), or what :func:`~.protocol.check_partition`
                refuses (nothing is attested).
        """
        me, partition = self.participant_id, self._partition_of(check)
        if self.attested is not None:
            if _canonical(self.attested["partition"]) != partition:
                raise SecureAggregationError(
                    f"{me}: this attempt's survivor set was attested already; refusing "
                    "to attest another"
                )
            return dict(self.attested["tags"])
        if self.answered is not None or self.round_key is None or self.enc_private is None:
            raise SecureAggregationError(
                f"{me}: this attempt's unmask request was answered already: nothing to attest"
            )
        self._check_partition(check.survivors, check.dropped)
        tags = consistency.attest(
            self._keys(), me=me, members=self.members, context=self.context,
            degree=self.degree, survivors=check.survivors, dropped=check.dropped,
        )  # fmt: skip
        self.attested = {"partition": partition, "tags": tags}
        return dict(tags)

    def _check_attested(self, request: UnmaskRequest, partition: list[list[str]]) -> None:
        """A request that drops anyone must be the partition this member attested, if it
        attested one, and carry enough valid attestations of it from other survivors
        (:func:`~.consistency.attestations_needed`); one that drops nobody needs none
        (disclosing no pairwise seed, the member cannot be exposed by it).

        Raises:
            SecureAggregationError: it is not, or it does not.
        """
        me = self.participant_id
        if self.attested is not None and _canonical(self.attested["partition"]) != partition:
            raise SecureAggregationError(
                f"{me}: the unmask request names another survivor set than the one this "
                "participant attested; refusing to disclose"
            )
        if not request.dropped:
            return
        graph = graph_of(self.members, self.degree, self.context)
        need = consistency.attestations_needed(
            len(self.members), self.degree, self.threshold, sparse=graph.sparse
        )
        valid = consistency.valid_attesters(
            self._keys(), me=me, members=self.members, context=self.context,
            degree=self.degree, survivors=request.survivors, dropped=request.dropped,
            attestations=request.attestations,
        )  # fmt: skip
        if len(valid) < need:
            raise SecureAggregationError(
                f"{me}: {len(valid)} valid attestations of the survivor set from other "
                f"survivors, {need} needed: refusing to disclose"
            )

    def disclose(self, request: UnmaskRequest) -> dict[str, dict[str, str]]:
        """The UnmaskResponse's fields for ``request``. A participant answers one
        partition of the members per attempt: the same request again gets the same
        answer; any other is refused (two partitions would let a coordinator collect a
        member's self mask from some holders and its pairwise seeds from the others), and
        so is one other than the partition it attested. A request that names a dropped
        member must carry enough attestations of that exact partition from the other
        survivors (:meth:`_check_attested`). The round's mask key is deleted once the
        answer is made.

        Raises:
            SecureAggregationError: no masked round to unmask, another round, another
                partition than the one answered or attested, too few valid attestations,
                or what :func:`~.protocol.disclose` refuses (nothing is disclosed).
        """
        me, partition = self.participant_id, self._partition_of(request)
        if self.answered is not None:
            if _canonical(self.answered["partition"]) != partition:
                raise SecureAggregationError(
                    f"{me}: this attempt's unmask request was answered for another "
                    "partition of the members; refusing a second one"
                )
            return dict(self.answered["reply"])
        if self.enc_private is None or self.round_key is None or self.threshold < 1:
            raise SecureAggregationError(f"{me}: no masked round to unmask")
        self._check_partition(request.survivors, request.dropped)
        self._check_attested(request, partition)
        try:
            sealed = {s: bytes.fromhex(c) for s, c in request.sealed.items()}
        except ValueError:
            raise SecureAggregationError(f"{me}: sealed shares are not hex") from None
        answer = disclose(
            me=me,
            keys=self._keys(),
            members=self.members,
            context=self.context,
            survivors=request.survivors,
            dropped=request.dropped,
            self_mask_shares=sealed,
            threshold=self.threshold,
            degree=self.degree,
        )
        reply = {
            "b_shares": {s: f"{x}:{y:x}" for s, (x, y) in answer.self_mask.items()},
            "pair_seeds": {d: seed.hex() for d, seed in answer.pair_seeds.items()},
        }
        self.answered = {"partition": partition, "reply": reply}
        self.round_key = None  # answered: the round's mask key is of no further use
        self._round_keys = None  # and neither are its pair seeds
        return dict(reply)

    def export(self) -> dict[str, Any]:
        """The masking state as JSON-able metadata, private keys included (it stays on the
        participant's disk, with the rest of its state)."""
        return {
            "enc_private": None if self.enc_private is None else self.enc_private.hex(),
            "announced": {pub: priv.hex() for pub, priv in self.announced.items()},
            "round_key": None if self.round_key is None else self.round_key.hex(),
            "answered": self.answered,
            "attested": self.attested,
            "members": [encode_member(m) for m in self.members],
            "context": self.context.decode(),
            "degree": self.degree,
            "threshold": self.threshold,
            "opened": None if self.opened is None else list(self.opened),
        }

    def restore(self, meta: dict[str, Any]) -> None:
        """Restore what :meth:`export` returned (a state saved before roles kept the
        attempt they opened restores as none opened).

        Raises:
            SecureAggregationError: the attempt opened last is not (run, round, attempt)
                (nothing is restored).
        """
        opened = _opened_of(meta.get("opened"))
        enc, round_key = meta.get("enc_private"), meta.get("round_key")
        self.enc_private = bytes.fromhex(enc) if enc else None
        self.announced = {
            str(pub): bytes.fromhex(priv) for pub, priv in (meta.get("announced") or {}).items()
        }
        self.round_key = bytes.fromhex(round_key) if round_key else None
        self._round_keys = None
        answered = meta.get("answered")
        self.answered = dict(answered) if isinstance(answered, dict) else None
        attested = meta.get("attested")
        self.attested = dict(attested) if isinstance(attested, dict) else None
        self.members = parse_members(tuple(meta.get("members", ())))
        self.context = str(meta.get("context", "")).encode()
        self.degree = int(meta.get("degree", 0))
        self.threshold = int(meta.get("threshold", 0))
        self.opened = opened


def _opened_of(saved: Any) -> tuple[str, int, int] | None:
    """:meth:`MaskingRole.export`'s ``opened`` back as (run, round, attempt).

    Raises:
        SecureAggregationError: it is neither None nor a run id and two integers.
    """
    if saved is None:
        return None
    ok = isinstance(saved, (list, tuple)) and len(saved) == 3
    if ok and isinstance(saved[0], str) and all(type(v) is int for v in saved[1:]):
        return (saved[0], saved[1], saved[2])
    raise SecureAggregationError(
        f"a saved masking state opened {saved!r}: not (run, round, attempt)"
    )


def masked_answer(
    role: MaskingRole, request: UnmaskRequest | SurvivorCheck
) -> UnmaskResponse | SurvivorAttestation:
    """``role``'s participant's reply to a masked round's request: its attestation of a
    SurvivorCheck's survivor set, or its disclosure for an UnmaskRequest (unsigned: the
    participant signs what it sends).

    Raises:
        SecureAggregationError: what :meth:`MaskingRole.attest` or
            :meth:`MaskingRole.disclose` refuses (nothing is answered).
    """
    me = role.participant_id
    common: dict[str, Any] = {
        "run_id": request.run_id,
        "round": request.round,
        "attempt": request.attempt,
        "sender": me,
        "participant_id": me,
    }
    if isinstance(request, SurvivorCheck):
        return SurvivorAttestation(**common, tags=role.attest(request))
    return UnmaskResponse(**common, **role.disclose(request))
