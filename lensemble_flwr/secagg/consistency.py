"""The consistency step of a masked round: members attest the survivor set to each other
before any of them discloses for it.

A coordinator that lies about who dropped could otherwise give different members
different survivor sets: the victim V alone is told that everybody else dropped (so it
discloses its pairwise seeds with all of them), the others that V survived (so they
disclose their shares of V's self mask), and V's input comes out of the transcript
unmasked. Bonawitz et al. (CCS 2017, the actively secure protocol) stop this with a
consistency round in which every survivor signs the survivor set and nobody discloses
before it has seen enough signatures on the set it was given.

Here the signatures are pairwise MACs. Two members X and Y already agree an X25519 secret
for the round attempt (their mask keys); from it HKDF derives, under a label of its own,
an *attestation key* K_XY next to the pairwise seed s_XY (:func:`~.keys.attest_key`), so
disclosing s_XY for a dropped neighbour says nothing of K_XY. X attests a survivor set U
to Y with HMAC-SHA256(K_XY, attester, recipient, context, U, dropped) (:func:`tag`): only
X and Y can make it, and it names who attests to whom, so a coordinator cannot hand X's
own tag back to X as Y's. A member attests one survivor set per round attempt and
discloses only for that set (:class:`~.participant_role.MaskingRole`), and it discloses
for a set that drops anyone only with :func:`attestations_needed` valid attestations on
that exact set from other survivors (in a sparse graph: from its surviving neighbours).
A set that drops nobody needs none: a member that sees no drop discloses no pairwise
seed, so its input stays masked whatever the others were told (docs/secure-aggregation.md
gives the argument).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence

from lensemble_flwr.secagg.keys import SecAggKeys
from lensemble_flwr.secagg.protocol import Member, graph_of, share_threshold

TAG_LABEL = b"lensemble-secagg/survivors"


def survivor_set(survivors: Sequence[str], dropped: Sequence[str]) -> bytes:
    """The canonical bytes of a partition of the members (sorted ids, JSON): what an
    attestation covers, whatever order the request listed them in."""
    return json.dumps([sorted(survivors), sorted(dropped)], separators=(",", ":")).encode()


def tag(
    key: bytes,
    *,
    attester: str,
    recipient: str,
    context: bytes,
    survivors: Sequence[str],
    dropped: Sequence[str],
) -> str:
    """``attester``'s attestation of the partition to ``recipient`` (hex HMAC-SHA256 under
    their attestation key): direction, round attempt and partition are all covered."""
    message = b"\x00".join(
        (
            TAG_LABEL,
            attester.encode(),
            recipient.encode(),
            context,
            survivor_set(survivors, dropped),
        )
    )
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def attestations_needed(member_count: int, degree: int, threshold: int, *, sparse: bool) -> int:
    """How many valid attestations from other survivors a member needs before it
    discloses for a partition that drops anyone. Full graph: t − 1 (the member's own
    check makes the t-th, as each member's own signature counts in Bonawitz et al.), and
    at least 1, so that some other survivor has committed to the same set. Sparse graph:
    t_k (:func:`~.protocol.share_threshold`) of its neighbours, the number of holders a
    self mask needs."""
    if sparse:
        return share_threshold(member_count, degree, threshold)
    return max(1, threshold - 1)


def attest(
    keys: SecAggKeys,
    *,
    me: str,
    members: Sequence[Member],
    context: bytes,
    degree: int,
    survivors: Sequence[str],
    dropped: Sequence[str],
) -> dict[str, str]:
    """``me``'s attestations of the partition, one for each of its surviving neighbours
    (every other survivor with the full graph). The partition is checked by the caller.

    Raises:
        SecureAggregationError: a neighbour's mask key is not usable.
    """
    near = graph_of(members, degree, context).near(me)
    alive = set(survivors)
    return {
        peer.pid: tag(
            keys.attest_key(peer.mask_public, context),
            attester=me,
            recipient=peer.pid,
            context=context,
            survivors=survivors,
            dropped=dropped,
        )
        for peer in members
        if peer.pid in near and peer.pid in alive
    }


def valid_attesters(
    keys: SecAggKeys,
    *,
    me: str,
    members: Sequence[Member],
    context: bytes,
    degree: int,
    survivors: Sequence[str],
    dropped: Sequence[str],
    attestations: Mapping[str, str],
) -> set[str]:
    """The members whose attestation to ``me`` of exactly this partition verifies; only
    survivors that are ``me``'s neighbours (other than ``me``) count, each once."""
    near = graph_of(members, degree, context).near(me)
    alive = set(survivors)
    by_id = {m.pid: m for m in members}
    valid = set()
    for attester, given in attestations.items():
        if attester == me or attester not in near or attester not in alive:
            continue
        peer = by_id.get(attester)
        if peer is None or len(peer.mask_public) != 32:
            continue
        expected = tag(
            keys.attest_key(peer.mask_public, context),
            attester=attester,
            recipient=me,
            context=context,
            survivors=survivors,
            dropped=dropped,
        )
        if hmac.compare_digest(expected, given):
            valid.add(attester)
    return valid
