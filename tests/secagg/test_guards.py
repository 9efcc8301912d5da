"""Every refusal of the masked-round machinery, tripped once."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from secagg_helpers import mask_release, update_of

from lensemble_flwr.config import AggregationConfig, LensembleConfig
from lensemble_flwr.coordinator.modes import masked_aggregation
from lensemble_flwr.errors import (
    ConfigError,
    NonDeterministicAggregation,
    RoundError,
    SecureAggregationError,
)
from lensemble_flwr.privacy.budget import PrivacyBudget
from lensemble_flwr.protocol.messages import (
    MessageKind,
    RoundOpen,
    UnmaskRequest,
    Update,
    from_wire,
    to_wire,
)
from lensemble_flwr.protocol.state import PseudoGradient
from lensemble_flwr.secagg import prg, shamir
from lensemble_flwr.secagg.aggregator import SecureAggregator, check_capacity
from lensemble_flwr.secagg.keys import SecAggKeys
from lensemble_flwr.secagg.participant_role import MaskingRole, encode_member
from lensemble_flwr.secagg.protocol import Disclosure, Member, context_of, mask

CONTEXT = context_of("run", 0, 1)
MASKED = LensembleConfig(federation={"secagg_threshold": 2, "min_participants": 2})
TEMPLATE = {"w": np.zeros(6, np.float32)}


@pytest.fixture
def trio():
    keys = {p: SecAggKeys.generate() for p in ("a", "b", "c")}
    members = [Member(p, k.mask_public, k.enc_public) for p, k in keys.items()]
    return keys, members


def masked_update(pid: str, keys, members, **changes) -> Update:
    release = mask(
        {"w": np.arange(6, dtype=np.int64)},
        me=pid,
        keys=keys[pid],
        members=members,
        threshold=2,
        context=CONTEXT,
    )
    return update_of(pid, release, **changes)


def aggregator(members, **config) -> SecureAggregator:
    return SecureAggregator(
        TEMPLATE,
        AggregationConfig(**config),
        members=members,
        threshold=2,
        context=CONTEXT,
    )


def test_the_aggregator_admits_only_well_formed_masked_updates_of_members(trio) -> None:
    keys, members = trio
    agg = aggregator(members)
    plain = Update(
        run_id="run",
        round=1,
        sender="a",
        participant_id="a",
        dataset_root=None,
        delta={"w": np.zeros(6, np.float32)},
        l2_norm=0.0,
        num_examples=1,
    )
    with pytest.raises(RoundError, match="masked updates only"):
        agg.admit(plain, weight=1)
    outsider_keys = {"z": SecAggKeys.generate(), **keys}
    outsiders = [
        *members,
        Member("z", outsider_keys["z"].mask_public, outsider_keys["z"].enc_public),
    ]
    with pytest.raises(RoundError, match="not a member"):
        agg.admit(masked_update("z", outsider_keys, outsiders), weight=1)
    with pytest.raises(RoundError, match="weight"):
        agg.admit(masked_update("a", keys, members), weight=0)
    with pytest.raises(RoundError, match="not hex"):
        agg.admit(
            masked_update("a", keys, members, sealed_shares={"a": "zz", "b": "00", "c": "00"}),
            weight=1,
        )
    with pytest.raises(RoundError, match="every member"):
        agg.admit(masked_update("a", keys, members, sealed_shares={"a": "00"}), weight=1)
    agg.admit(masked_update("a", keys, members), weight=1)
    with pytest.raises(RoundError, match="already contributed"):
        agg.admit(masked_update("a", keys, members), weight=1)


def test_disclosures_come_from_survivors_and_give_one_secret_per_sender(trio) -> None:
    keys, members = trio
    agg = aggregator(members)
    agg.admit(masked_update("a", keys, members), weight=1)
    agg.admit(masked_update("b", keys, members), weight=1)  # c dropped
    with pytest.raises(RoundError, match="only survivors"):
        agg.disclose("c", Disclosure(self_mask={}, pair_seeds={}))
    with pytest.raises(RoundError, match="self mask of a member that dropped"):
        agg.disclose("a", Disclosure(self_mask={"c": (1, 2)}, pair_seeds={"c": bytes(32)}))
    with pytest.raises(RoundError, match="pairwise seed with a survivor"):
        agg.disclose("a", Disclosure(self_mask={"b": (1, 2)}, pair_seeds={"b": bytes(32)}))
    with pytest.raises(RoundError, match="32 bytes"):
        agg.disclose("a", Disclosure(self_mask={}, pair_seeds={"c": bytes(31)}))
    assert agg.disclosed == []  # nothing refused was kept


def test_a_revealed_sum_that_does_not_reproduce_is_caught(trio) -> None:
    keys, members = trio
    agg = aggregator(members)
    for pid in ("a", "b", "c"):
        agg.admit(masked_update(pid, keys, members), weight=1)
    for holder, request in agg.disclosure_requests().items():
        from lensemble_flwr.secagg.protocol import disclose

        agg.disclose(
            holder,
            disclose(
                me=holder,
                keys=keys[holder],
                members=members,
                context=CONTEXT,
                survivors=request.survivors,
                dropped=request.dropped,
                self_mask_shares=request.self_mask_shares,
                threshold=2,
            ),
        )
    result = agg.reveal()
    np.testing.assert_array_equal(result.sums["w"], 3 * np.arange(6))
    agg.verify(result)
    tampered = {"w": result.sums["w"] + 1}
    with pytest.raises(NonDeterministicAggregation):
        agg.verify(dataclasses.replace(result, sums=tampered))
    # an aggregator holding the same masked inputs but none of the disclosures (the
    # transcript is gone) cannot repeat the reveal, so it never vouches for the sum
    bare = aggregator(members)
    for pid in ("a", "b", "c"):
        bare.admit(masked_update(pid, keys, members), weight=1)
    with pytest.raises(NonDeterministicAggregation, match="no longer reveals"):
        bare.verify(result)


def test_a_member_set_must_be_well_formed_and_include_the_masker(trio) -> None:
    keys, members = trio
    values = {"w": np.arange(6, dtype=np.int64)}
    with pytest.raises(SecureAggregationError, match="duplicate member ids"):
        mask(
            values,
            me="a",
            keys=keys["a"],
            members=[*members, members[0]],
            threshold=2,
            context=CONTEXT,
        )
    with pytest.raises(SecureAggregationError, match="not a member"):
        mask(values, me="z", keys=keys["a"], members=members, threshold=2, context=CONTEXT)


def test_a_participant_without_keys_or_a_masked_round_neither_masks_nor_discloses(
    trio,
) -> None:
    _keys, members = trio
    role = MaskingRole("a")  # never committed keys
    opened = RoundOpen.model_construct(
        run_id="run",
        round=1,
        attempt=1,
        secagg_prg=prg.PRG_ID,
        secagg_members=tuple(encode_member(m) for m in members),
        secagg_threshold=2,
    )
    release = PseudoGradient(
        participant_id="a",
        round=1,
        delta={"w": np.zeros(6, np.float32)},
        l2_norm=0.0,
        dataset_root=None,
        num_examples=1,
    )
    with pytest.raises(SecureAggregationError, match="no keys"):
        mask_release(role, release, opened, LensembleConfig())
    request = UnmaskRequest(
        run_id="run",
        round=1,
        sender="coordinator",
        attempt=1,
        survivors=("a",),
        dropped=(),
        sealed={},
    )
    with pytest.raises(SecureAggregationError, match="no masked round"):
        role.disclose(request)


def test_a_member_set_that_could_overflow_the_sum_is_refused(trio) -> None:
    _, members = trio
    with pytest.raises(ConfigError, match="overflow"):
        aggregator(members * 200, fraction_bits=40, max_weight=2**10, max_abs_update=256.0)


def test_a_masked_sum_under_uniform_weighting_is_sized_at_weight_one() -> None:
    """Every weight is 1 under uniform weighting: at the default max-weight (2**16) the
    capacity check capped a masked round at 511 members, and a C = 1000 round stopped
    the federation at round 1. With num-examples weighting the cap stays, and is
    checked before any mask key is spent."""
    uniform = LensembleConfig(federation={"secagg_threshold": 2, "min_participants": 2})
    assert masked_aggregation(uniform).max_weight == 1
    check_capacity(1000, masked_aggregation(uniform))  # fits
    with pytest.raises(ConfigError, match=r"1000 members x max-weight 65536"):
        check_capacity(1000, uniform.aggregation)
    weighted = LensembleConfig(
        federation={"secagg_threshold": 2, "min_participants": 2, "weighting": "num-examples"}
    )
    assert masked_aggregation(weighted) == weighted.aggregation


def test_a_masked_round_too_large_for_the_sum_spends_no_mask_key(tmp_path: Path) -> None:
    from federation_helpers import federation

    config = LensembleConfig(
        federation={
            "secagg_threshold": 2, "min_participants": 2, "weighting": "num-examples",
            "open_timeout": 10.0, "collect_timeout": 10.0,
        },
        aggregation={"fraction_bits": 40, "max_weight": 2**15, "max_abs_update": 90.0},
        inner={"steps": 1},
    )  # fmt: skip
    coordinator, _, _ = federation(tmp_path, participants=3, config=config)
    outcome = coordinator.run_attempt()  # 3 x 2**61.5 >= 2**63: cannot be summed
    assert isinstance(outcome.error, ConfigError)
    assert "could overflow the int64 sum" in str(outcome.error)
    peers = ("p00", "p01", "p02")
    assert all(coordinator.registry.keyed(p) for p in peers)  # no mask key was spent


def test_an_unmask_response_with_both_shares_of_a_sender_is_malformed() -> None:
    payload = {
        "kind": MessageKind.UNMASK_RESPONSE.value,
        "run_id": "run",
        "round": 1,
        "sender": "a",
        "participant_id": "a",
        "b_shares": {"c": "1:2"},
        "pair_seeds": {"c": "00" * 32},
    }
    with pytest.raises(RoundError, match="both secrets"):
        from_wire(payload)


def test_a_participant_refuses_to_mask_an_out_of_range_release_or_unmask_another_round(
    trio,
) -> None:
    keys, members = trio
    role = MaskingRole("a")
    role.enc_private = keys["a"].enc_private
    role.announced = {keys["a"].mask_public.hex(): keys["a"].mask_private}
    config = LensembleConfig(
        aggregation={"max_abs_update": 1.0},
        federation={"secagg_threshold": 2, "min_participants": 2},
    )
    opened = RoundOpen.model_construct(
        run_id="run",
        round=1,
        attempt=1,
        secagg_prg=prg.PRG_ID,
        secagg_members=tuple(encode_member(m) for m in members),
        secagg_threshold=2,
    )
    huge = PseudoGradient(
        participant_id="a",
        round=1,
        delta={"w": np.full(6, 5.0, np.float32)},
        l2_norm=0.0,
        dataset_root=None,
        num_examples=1,
    )
    with pytest.raises(RoundError, match="max-abs-update"):
        mask_release(role, huge, opened, config)
    # a NaN or an infinity is never masked (the plaintext ingress check, participant-side)
    for bad in (np.nan, np.inf):
        spoiled = dataclasses.replace(huge, delta={"w": np.array([0.5, bad], np.float32)})
        with pytest.raises(RoundError, match="NaN or infinity"):
            mask_release(role, spoiled, opened, config)
    int8 = dataclasses.replace(huge, delta={"w": np.ones(6, np.int8)}, scales={"w": np.nan})
    with pytest.raises(RoundError, match="not finite and positive"):
        mask_release(role, int8, opened, config)
    fine = dataclasses.replace(huge, delta={"w": np.full(6, 0.5, np.float32)})
    fields = mask_release(role, fine, opened, config)
    assert fields["next_mask_key"] in role.announced  # the next round's, announced
    for again in (opened, opened.model_copy(update={"attempt": 2})):  # a key masks once
        with pytest.raises(SecureAggregationError, match="already used"):
            mask_release(role, fine, again, config)
    other = UnmaskRequest(
        run_id="run",
        round=8,
        sender="coordinator",
        attempt=1,
        survivors=("a",),
        dropped=(),
        sealed={},
    )
    with pytest.raises(SecureAggregationError, match="another round"):
        role.disclose(other)


def test_budget_prg_and_shamir_refuse_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="epsilon"):
        PrivacyBudget(tmp_path, "k", epsilon=0.0, delta=1e-5)
    with pytest.raises(ConfigError, match="accountant"):
        PrivacyBudget(tmp_path, "k", epsilon=1.0, delta=1e-5, accountant="gdp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="int64 accumulator"):
        prg.add_streams([(bytes(32), 1)], np.zeros(4, np.float64))
    with pytest.raises(ValueError, match="32 bytes"):
        prg.add_streams([(b"short", 1)], np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="base"):
        prg.add_streams([(bytes(32), 1)], np.zeros(4, np.int64), base=np.zeros(5, np.int64))
    with pytest.raises(ValueError, match="base"):
        prg.add_streams([(bytes(32), 1)], np.zeros(4, np.int64), base=np.zeros(4, np.float64))
    with pytest.raises(ValueError, match="threshold"):
        shamir.split(bytes(32), 4, 3)


def test_a_masked_update_carries_int64_and_shares_only(trio) -> None:
    keys, members = trio
    good = to_wire(masked_update("a", keys, members))
    for changes in (
        {"sealed_shares": None},
        {"delta": {"w": np.zeros(6, np.float32)}},
        {"masked": False},
    ):
        with pytest.raises(RoundError):
            from_wire({**good, **changes})


def test_a_participant_masks_only_with_a_key_it_announced_and_its_own_sealing_key(trio) -> None:
    keys, members = trio
    role = MaskingRole("a")
    role.keys_for_commitment()  # announces a key the member list below does not carry
    opened = RoundOpen.model_construct(
        run_id="run",
        round=1,
        attempt=1,
        secagg_prg=prg.PRG_ID,
        secagg_members=tuple(encode_member(m) for m in members),
        secagg_threshold=2,
        secagg_neighbours=0,
    )
    release = PseudoGradient(
        participant_id="a",
        round=1,
        delta={"w": np.zeros(6, np.float32)},
        l2_norm=0.0,
        dataset_root=None,
        num_examples=1,
    )
    with pytest.raises(SecureAggregationError, match="never announced"):
        mask_release(role, release, opened, MASKED)
    role.announced[keys["a"].mask_public.hex()] = keys["a"].mask_private  # the listed key
    with pytest.raises(SecureAggregationError, match="another sealing key"):
        mask_release(role, release, opened, MASKED)


def test_a_masked_update_carries_no_norm_and_a_plaintext_one_no_mask_key(trio) -> None:
    keys, members = trio
    good = to_wire(masked_update("a", keys, members))
    with pytest.raises(RoundError, match="no norm"):
        from_wire({**good, "l2_norm": 1.0})
    plain = to_wire(
        Update(
            run_id="run",
            round=1,
            sender="a",
            participant_id="a",
            dataset_root=None,
            delta={"w": np.zeros(6, np.float32)},
            num_examples=1,
        )
    )
    with pytest.raises(RoundError, match="mask keys belong to masked updates"):
        from_wire({**plain, "next_mask_key": "00" * 32})


@pytest.mark.parametrize("named", ["", "chacha20"])
def test_a_masked_round_under_another_prg_is_refused_before_training(named: str) -> None:
    """Masks drawn with two PRGs do not cancel: the revealed sum would be noise that no
    check after the unmasking can tell from a sum. A coordinator of another version names
    another PRG (or none): the participant refuses the round before it trains."""
    role = MaskingRole("a")
    role.keys_for_commitment()
    config = LensembleConfig(federation={"secagg_threshold": 2, "min_participants": 2})
    opened = RoundOpen.model_construct(
        run_id="run", round=1, attempt=1, secagg_threshold=2, secagg_prg=named
    )
    with pytest.raises(SecureAggregationError, match="masks with PRG"):
        role.check_round(opened, config)
