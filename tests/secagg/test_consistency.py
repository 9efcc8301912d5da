"""The consistency step of masked rounds: every guard of attesting a survivor set and of
disclosing for one, tripped once (the attacks it stops: tests/adversarial/test_secagg_lies.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from federation_helpers import federation, small_config
from secagg_helpers import mask_release, update_of

from lensemble_flwr.config import AggregationConfig, LensembleConfig
from lensemble_flwr.errors import RoundError, SecureAggregationError
from lensemble_flwr.protocol.messages import (
    MessageKind,
    RoundOpen,
    SurvivorAttestation,
    SurvivorCheck,
    UnmaskRequest,
    from_wire,
    to_wire,
)
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.protocol.state import PseudoGradient
from lensemble_flwr.secagg import consistency, prg
from lensemble_flwr.secagg.aggregator import SecureAggregator
from lensemble_flwr.secagg.keys import SecAggKeys, attest_key, pair_seed, public_key
from lensemble_flwr.secagg.participant_role import MaskingRole, encode_member
from lensemble_flwr.secagg.protocol import Member, context_of, mask
from lensemble_flwr.testing import DeliveryLog, FaultPlan
from lensemble_flwr.transports.base import COORDINATOR
from tests.strategies.test_grid_transport import _serverapp_identity  # noqa: F401  (autouse)

CONTEXT = context_of("run", 1, 1)
IDS = ("a", "b", "c", "d")
CONFIG = LensembleConfig(federation={"secagg_threshold": 3, "min_participants": 3})


def _partition(*dropped: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return tuple(p for p in IDS if p not in dropped), tuple(p for p in IDS if p in dropped)


@pytest.fixture
def roles() -> dict[str, MaskingRole]:
    """Four roles that masked for round 1 of run "run" (full graph, t = 3)."""
    made = {}
    for pid in IDS:
        role = MaskingRole(pid)
        role.keys_for_commitment()
        made[pid] = role
    members = [
        Member(p, bytes.fromhex(next(iter(r.announced))), public_key(r.enc_private or b""))
        for p, r in made.items()
    ]
    opened = RoundOpen.model_construct(
        run_id="run",
        round=1,
        attempt=1,
        secagg_threshold=3,
        secagg_neighbours=0,
        secagg_prg=prg.PRG_ID,
        secagg_members=tuple(encode_member(m) for m in members),
    )
    released = PseudoGradient(
        participant_id="a",
        round=1,
        delta={"w": np.zeros(3, np.float32)},
        l2_norm=0.0,
        dataset_root=None,
        num_examples=1,
    )
    for role in made.values():
        mask_release(role, released, opened, CONFIG)
    return made


def check(*dropped: str, **changes: Any) -> SurvivorCheck:
    survivors, gone = _partition(*dropped)
    fields = dict(
        run_id="run", round=1, attempt=1, sender=COORDINATOR, survivors=survivors, dropped=gone
    )
    return SurvivorCheck(**{**fields, **changes})


def request(attestations: dict[str, str], *dropped: str) -> UnmaskRequest:
    survivors, gone = _partition(*dropped)
    return UnmaskRequest(
        run_id="run",
        round=1,
        attempt=1,
        sender=COORDINATOR,
        survivors=survivors,
        dropped=gone,
        sealed={},
        attestations=attestations,
    )


def attested_to(roles: dict[str, MaskingRole], me: str, *dropped: str) -> dict[str, str]:
    """The attestations of the partition addressed to ``me`` by every other survivor."""
    tags = {}
    for pid in _partition(*dropped)[0]:
        if pid != me:
            tags[pid] = roles[pid].attest(check(*dropped))[me]
    return tags


def test_the_attestation_key_is_not_the_pair_seed_and_is_symmetric() -> None:
    one, two = SecAggKeys.generate(), SecAggKeys.generate()
    key = attest_key(one.mask_private, two.mask_public, CONTEXT)
    assert key == attest_key(two.mask_private, one.mask_public, CONTEXT)
    assert key == one.attest_key(two.mask_public, CONTEXT)
    assert key != pair_seed(one.mask_private, two.mask_public, CONTEXT)
    assert key != attest_key(one.mask_private, two.mask_public, context_of("run", 1, 2))


def test_a_tag_covers_direction_round_and_partition() -> None:
    key = bytes(32)
    base = dict(attester="a", recipient="b", context=CONTEXT, survivors=("a", "b"), dropped=("c",))
    tag = consistency.tag(key, **base)
    assert tag == consistency.tag(key, **{**base, "survivors": ("b", "a")})  # order: canonical
    for change in (
        {"attester": "b", "recipient": "a"},
        {"context": context_of("run", 1, 2)},
        {"survivors": ("a", "b", "c"), "dropped": ()},
    ):
        assert consistency.tag(key, **{**base, **change}) != tag


def test_the_attestations_needed() -> None:
    assert consistency.attestations_needed(4, 0, 3, sparse=False) == 2  # t - 1 others
    assert consistency.attestations_needed(4, 0, 1, sparse=False) == 1  # never none
    assert consistency.attestations_needed(8, 4, 3, sparse=True) == 2  # t_k


def test_a_member_attests_one_survivor_set_per_attempt(roles) -> None:
    tags = roles["a"].attest(check("d"))
    assert set(tags) == {"b", "c"}  # every other survivor, not the dropped one
    assert roles["a"].attest(check("d")) == tags  # the same check: the same answer
    with pytest.raises(SecureAggregationError, match="attested already"):
        roles["a"].attest(check("c"))
    with pytest.raises(SecureAggregationError, match="another survivor set"):
        roles["a"].disclose(request(attested_to(roles, "a", "d"), "c"))  # not the one attested
    restored = MaskingRole("a")
    restored.restore(roles["a"].export())  # the attested set is kept with the state
    assert restored.attested == roles["a"].attested


@pytest.mark.parametrize(
    ("sent", "complaint"),
    [
        ({"dropped": ("c", "d"), "survivors": ("a", "b")}, "2 survivors, threshold 3"),
        ({"dropped": ("a",), "survivors": ("b", "c", "d")}, "not named a survivor"),
        ({"dropped": (), "survivors": ("a", "b", "c")}, "not the members"),
        ({"attempt": 2}, "another round"),
    ],
)
def test_a_member_attests_only_a_partition_it_would_disclose_for(
    roles, sent: dict, complaint: str
) -> None:
    with pytest.raises(SecureAggregationError, match=complaint):
        roles["a"].attest(check("d", **sent))
    assert roles["a"].attested is None


def test_a_member_without_a_masked_round_or_after_answering_attests_nothing(roles) -> None:
    with pytest.raises(SecureAggregationError, match="no masked round"):
        MaskingRole("a").attest(check("d"))
    roles["a"].disclose(request({}))  # nobody dropped: no attestations needed
    with pytest.raises(SecureAggregationError, match="answered already"):
        roles["a"].attest(check())


def test_a_member_discloses_for_a_drop_only_with_enough_valid_attestations(roles) -> None:
    tags = attested_to(roles, "a", "d")
    assert set(tags) == {"b", "c"}
    for given in (
        {},
        {"b": tags["b"]},  # one: t - 1 = 2 needed
        {"b": tags["b"], "c": "00" * 32},  # a forged tag
        {"b": tags["b"], "d": tags["c"]},  # a tag under another attester's name
        {"b": tags["b"], "a": roles["a"].attest(check("d"))["b"]},  # its own, reflected
    ):
        with pytest.raises(SecureAggregationError, match="valid attestations"):
            roles["a"].disclose(request(given, "d"))
        assert roles["a"].answered is None and roles["a"].round_key is not None
    answer = roles["a"].disclose(request(tags, "d"))
    assert set(answer["pair_seeds"]) == {"d"}


def test_an_attestation_of_another_set_does_not_verify(roles) -> None:
    roles["b"].attest(check("d"))
    roles["c"].attest(check("d"))
    wrong = {p: roles[p].attest(check("d"))["a"] for p in ("b", "c")}
    with pytest.raises(SecureAggregationError, match="valid attestations"):
        roles["a"].disclose(request(wrong, "b"))  # a (unattested) lie: b dropped


def test_attestation_tags_must_be_hex_digests_at_ingress() -> None:
    good = SurvivorAttestation(
        run_id="run", round=1, sender="a", participant_id="a", tags={"b": "ab" * 32}
    )
    with pytest.raises(RoundError, match="tags"):
        from_wire({**to_wire(good), "tags": {"b": "not-a-tag"}})
    with pytest.raises(RoundError, match="attestations"):
        from_wire({**to_wire(request({})), "attestations": {"b": "zz"}})


def _aggregator(senders: tuple[str, ...]) -> SecureAggregator:
    """The secure aggregator of a round of members ``IDS`` in which ``senders`` masked."""
    keys = {p: SecAggKeys.generate() for p in IDS}
    members = [Member(p, k.mask_public, k.enc_public) for p, k in keys.items()]
    agg = SecureAggregator(
        {"w": np.zeros(3, np.float32)},
        AggregationConfig(),
        members=members,
        threshold=3,
        context=CONTEXT,
    )
    for pid in senders:
        release = mask(
            {"w": np.arange(3, dtype=np.int64)},
            me=pid,
            keys=keys[pid],
            members=members,
            threshold=3,
            context=CONTEXT,
        )
        agg.admit(update_of(pid, release), weight=1)
    return agg


def test_the_aggregator_relays_attestations_from_survivors_to_survivors_only() -> None:
    agg = _aggregator(("a", "b", "c"))  # d dropped
    assert agg.survivor_set() == (("a", "b", "c"), ("d",))
    with pytest.raises(RoundError, match="only survivors"):
        agg.attest("d", {"a": "00" * 32})
    with pytest.raises(RoundError, match="not its surviving neighbours"):
        agg.attest("a", {"d": "00" * 32})
    with pytest.raises(RoundError, match="not its surviving neighbours"):
        agg.attest("a", {"a": "00" * 32})
    agg.attest("a", {"b": "01" * 32, "c": "02" * 32})
    with pytest.raises(RoundError, match="already"):
        agg.attest("a", {"b": "01" * 32})
    assert not agg.all_attested()
    with pytest.raises(SecureAggregationError, match="fewer than 2 attestations"):
        agg.check_attested()  # b and c would get one each
    agg.attest("b", {"a": "03" * 32, "c": "04" * 32})
    agg.attest("c", {"a": "05" * 32, "b": "06" * 32})
    assert agg.all_attested()
    agg.check_attested()
    requests = agg.disclosure_requests()
    assert requests["a"].attestations == {"b": "03" * 32, "c": "05" * 32}


def test_with_nobody_dropped_there_is_nothing_to_attest() -> None:
    agg = _aggregator(IDS)
    assert agg.survivor_set() is None
    agg.check_attested()  # nothing needed
    with pytest.raises(RoundError, match="nobody dropped"):
        agg.attest("a", {"b": "00" * 32})


def test_a_survivor_that_does_not_attest_aborts_the_attempt_before_anyone_discloses(
    tmp_path: Path,
) -> None:
    """p01's attestation is malformed (rejected at ingress): it counts as not answering;
    p00 and p03 would get one attestation each, two needed: nobody is asked to disclose,
    and the retry (p02 gone) closes."""

    def garble(payload: dict) -> dict:
        payload["tags"] = {"p00": "not-a-tag"}
        return payload

    faults = (
        FaultPlan()
        .drop("p02", round=1, at=RoundState.COLLECTING)
        .corrupt("p01", round=1, kind=MessageKind.SURVIVOR_ATTESTATION, mutate=garble)
    )
    config = small_config(secagg_threshold=3, min_participants=3)
    coordinator, network, _ = federation(tmp_path, config=config, faults=faults)
    seen = DeliveryLog(network, dest=COORDINATOR)
    coordinator.run(1)
    first, second = coordinator.outcomes
    assert first.state is RoundState.ABORTED and isinstance(first.error, SecureAggregationError)
    assert "attestations" in str(first.error)
    assert first.rejected >= 1  # the malformed attestation
    assert second.state is RoundState.CLOSED and second.count == 3
    responses = seen.payloads(MessageKind.UNMASK_RESPONSE, round=1)
    assert responses and {p["attempt"] for p in responses} == {2}  # none in attempt 1


def test_signed_attestations_are_admitted_and_an_unsigned_one_is_forged(tmp_path: Path) -> None:
    """With identity keys, a member signs its SurvivorAttestation like its other messages;
    one stripped of its signature is rejected (ForgedMessage) and counts as not
    answering."""
    from federation_helpers import signed_federation

    from lensemble_flwr.identity.signing import IdentityKey

    keys = {f"p0{i}": IdentityKey.generate() for i in range(4)}
    config = small_config(secagg_threshold=3, min_participants=3)
    faults = FaultPlan().drop("p02", round=1, at=RoundState.COLLECTING)
    coordinator, network, _ = signed_federation(tmp_path, keys, config=config, faults=faults)
    seen = DeliveryLog(network, dest=COORDINATOR)
    coordinator.run(1)
    (outcome,) = coordinator.outcomes
    assert outcome.state is RoundState.CLOSED and outcome.count == 3
    signed = seen.payloads(MessageKind.SURVIVOR_ATTESTATION, round=1)
    assert len(signed) == 3 and all(p["signature"] for p in signed)

    def unsign(payload: dict) -> dict:
        payload["signature"] = None
        return payload

    faults = (
        FaultPlan()
        .drop("p02", round=1, at=RoundState.COLLECTING)
        .corrupt("p01", round=1, kind=MessageKind.SURVIVOR_ATTESTATION, mutate=unsign)
    )
    coordinator, _, _ = signed_federation(tmp_path / "unsigned", keys, config=config, faults=faults)
    coordinator.run(1)
    first = coordinator.outcomes[0]
    assert first.state is RoundState.ABORTED and isinstance(first.error, SecureAggregationError)
    assert first.rejected >= 1
