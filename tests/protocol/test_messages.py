"""Ingress validation of the four control messages (property-based); message kinds on the
wire; the digests messages hash to."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from federation_helpers import federation
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lensemble_flwr.canonical import canonical_json
from lensemble_flwr.errors import RoundError
from lensemble_flwr.identity.signing import signing_digest
from lensemble_flwr.protocol.messages import (
    PARTICIPANT_KINDS,
    Commitment,
    ControlMessage,
    MessageKind,
    ParticipantMessage,
    Refusal,
    RoundClose,
    RoundOpen,
    SurvivorAttestation,
    SurvivorCheck,
    UnmaskRequest,
    UnmaskResponse,
    Update,
    canonical_fields,
    from_wire,
    kind_of,
    message_digest,
    to_wire,
)
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.transports.faults import FaultPlan

ROOT = "ab" * 32


def good_update(**changes: Any) -> dict[str, Any]:
    payload = to_wire(
        Update(
            run_id="run",
            round=3,
            sender="p1",
            participant_id="p1",
            dataset_root=ROOT,
            delta={"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)},
            l2_norm=1.0,
            num_examples=10,
        )
    )
    payload.update(changes)
    return payload


def test_valid_messages_round_trip_through_the_wire() -> None:
    messages = [
        from_wire(good_update()),
        Commitment(
            run_id="r", round=1, sender="p", participant_id="p", dataset_root=ROOT, num_examples=3
        ),
        RoundOpen(
            run_id="r",
            round=1,
            sender="coordinator",
            global_hash=ROOT,
            params={"w": np.zeros(2, np.float32)},
            sketch_seed=1,
            h_steps=2,
        ),
        RoundClose(
            run_id="r",
            round=1,
            sender="coordinator",
            previous_hash=ROOT,
            global_hash=ROOT,
            count=1,
            record_hash=ROOT,
        ),
    ]
    for message in messages:
        again = from_wire(to_wire(message))
        assert type(again) is type(message)
        assert message_digest(again) == message_digest(message)


def test_update_records_its_largest_magnitude() -> None:
    update = from_wire(good_update(delta={"w": np.array([0.5, -7.0, 3.0], np.float32)}))
    assert update.max_abs == 7.0


def test_digest_changes_with_any_field_or_value() -> None:
    base = message_digest(from_wire(good_update()))
    assert message_digest(from_wire(good_update(round=4))) != base
    assert message_digest(from_wire(good_update(dataset_root="cd" * 32))) != base
    nudged = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}
    nudged["b"][1] = np.nextafter(np.float32(1), np.float32(2))
    assert message_digest(from_wire(good_update(delta=nudged))) != base


MALFORMED = [
    ("missing field", lambda p: p.pop("dataset_root")),
    ("extra field", lambda p: p.update(secret="x")),
    ("unknown kind", lambda p: p.update(kind="gradient")),
    ("negative round", lambda p: p.update(round=-1)),
    ("round as text", lambda p: p.update(round="two")),
    ("root not hex", lambda p: p.update(dataset_root="z" * 64)),
    ("root too short", lambda p: p.update(dataset_root="ab")),
    ("sender is not the participant", lambda p: p.update(sender="p2")),
    ("empty delta", lambda p: p.update(delta={})),
    ("NaN in delta", lambda p: p["delta"].update(b=np.array([np.nan], np.float32))),
    ("inf in delta", lambda p: p["delta"].update(b=np.array([np.inf], np.float32))),
    ("integer array", lambda p: p["delta"].update(b=np.ones(3, np.int64))),
    ("list instead of array", lambda p: p["delta"].update(b=[1.0, 2.0])),
    ("np.matrix", lambda p: p["delta"].update(b=np.matrix(np.ones((1, 3), np.float32)))),
    ("masked array", lambda p: p["delta"].update(b=np.ma.array(np.ones(3, np.float32)))),
    ("non-string array name", lambda p: p["delta"].update({3: np.ones(1, np.float32)})),
    ("negative norm", lambda p: p.update(l2_norm=-1.0)),
    ("NaN norm", lambda p: p.update(l2_norm=float("nan"))),
    ("zero examples", lambda p: p.update(num_examples=0)),
    ("attempt zero", lambda p: p.update(attempt=0)),
]


@pytest.mark.parametrize("mutate", [m for _, m in MALFORMED], ids=[n for n, _ in MALFORMED])
def test_malformed_update_is_rejected_with_round_error(mutate) -> None:
    payload = good_update()
    payload["delta"] = dict(payload["delta"])
    mutate(payload)
    with pytest.raises(RoundError, match="malformed"):
        from_wire(payload)


json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
arrays = st.builds(
    lambda shape, dtype, fill: np.full(shape, fill, dtype=dtype),
    st.lists(st.integers(0, 3), max_size=2).map(tuple),
    st.sampled_from([np.float32, np.float64, np.int32, np.bool_]),
    st.floats(allow_nan=True, allow_infinity=True, width=32) | st.integers(-3, 3),
)
field_values = json_like | arrays | st.dictionaries(st.text(max_size=4), arrays, max_size=3)


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
@settings(max_examples=300, deadline=None)
@given(
    base=st.sampled_from([*(kind.value for kind in MessageKind), "garbage"]),
    changes=st.dictionaries(
        st.sampled_from(
            [
                "kind",
                "run_id",
                "round",
                "sender",
                "participant_id",
                "dataset_root",
                "delta",
                "params",
                "l2_norm",
                "num_examples",
                "attempt",
                "global_hash",
                "extra",
            ]
        ),
        field_values,
        max_size=4,
    ),
)
def test_ingress_never_raises_anything_but_round_error(base: str, changes: dict) -> None:
    payload: Any = good_update() if base == MessageKind.UPDATE.value else {"kind": base}
    payload = {**payload, **changes} if isinstance(payload, dict) else payload
    try:
        message = from_wire(payload)
    except RoundError:
        return
    # whatever validates is a well-formed message whose digest is computable
    assert message_digest(message)


@pytest.mark.parametrize("payload", [None, 3, "update", b"bytes", ["kind", "update"]])
def test_non_mapping_payloads_are_rejected(payload: Any) -> None:
    with pytest.raises(RoundError):
        from_wire(payload)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(which=st.lists(st.integers(0, len(MALFORMED) - 1), min_size=1, max_size=3, unique=True))
def test_malformed_messages_never_move_the_round(tmp_path_factory, which: list[int]) -> None:
    """A round with malformed updates from some senders closes over the honest rest."""
    tmp: Path = tmp_path_factory.mktemp("ingress")
    faults = FaultPlan()
    corrupted = []
    for slot, index in enumerate(which):
        mutate = MALFORMED[index][1]

        def apply(payload: dict, mutate=mutate) -> dict:
            payload["delta"] = dict(payload["delta"])
            mutate(payload)
            return payload

        pid = f"p0{slot}"
        corrupted.append(pid)
        faults.corrupt(pid, round=1, kind=MessageKind.UPDATE, mutate=apply)
    coordinator, _, _ = federation(tmp, participants=6, faults=faults)
    before = coordinator.global_state().params_hash
    coordinator.run(1)
    outcome = coordinator.outcomes[0]
    assert outcome.state is RoundState.CLOSED
    assert outcome.rejected == len(which)
    assert set(outcome.contributors) == {f"p0{i}" for i in range(6)} - set(corrupted)
    assert coordinator.global_state().params_hash != before


# -- message kinds ----------------------------------------------------------------------------
def one_of_each_kind() -> dict[MessageKind, ControlMessage]:
    """One fixed message of every kind (their digests are pinned below)."""
    common = {"run_id": "run", "round": 3}
    mine = {**common, "sender": "p1", "participant_id": "p1"}
    messages: list[ControlMessage] = [
        RoundOpen(
            **common,
            sender="coordinator",
            global_hash=ROOT,
            params={"w": np.arange(3, dtype=np.float32)},
            sketch_seed=7,
            h_steps=2,
        ),
        Commitment(**mine, dataset_root=ROOT, num_examples=3),
        Update(
            **mine,
            dataset_root=ROOT,
            delta={"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
            l2_norm=1.0,
            num_examples=10,
        ),
        Refusal(**mine, error="PrivacyBudgetExceeded", reason="spent"),
        UnmaskRequest(
            **common,
            sender="coordinator",
            survivors=("p1",),
            dropped=("p2",),
            sealed={"p1": "00ff"},
        ),
        UnmaskResponse(**mine, b_shares={"p1": "1:ab"}, pair_seeds={"p2": "cd" * 32}),
        RoundClose(
            **common,
            sender="coordinator",
            previous_hash=ROOT,
            global_hash=ROOT,
            count=1,
            record_hash=ROOT,
        ),
        SurvivorCheck(**common, sender="coordinator", survivors=("p1",), dropped=("p2",)),
        SurvivorAttestation(**mine, tags={"p3": "ab" * 32}),
    ]
    by_kind = {m.kind: m for m in messages}
    assert list(by_kind) == list(MessageKind)  # one class per kind, none left out
    return by_kind


@pytest.mark.parametrize("kind", list(MessageKind), ids=lambda k: k.value)
def test_every_kind_round_trips_through_the_wire_to_its_class(kind: MessageKind) -> None:
    message = one_of_each_kind()[kind]
    payload = to_wire(message)
    assert payload["kind"] == kind.value
    assert type(payload["kind"]) is str  # not the enum: what Flower records and JSON carry
    again = from_wire(payload)
    assert type(again) is type(message) and again.kind is kind
    assert kind_of(payload) is kind and kind_of(message) is kind
    assert message_digest(again) == message_digest(message)
    # the wire string alone selects the class; the enum member is accepted as well
    assert type(from_wire({**payload, "kind": kind})) is type(message)
    assert str(kind) == f"{kind}" == kind.value  # what error messages and logs print


def test_every_serialisation_of_a_message_carries_the_plain_kind_string() -> None:
    for kind, message in one_of_each_kind().items():
        dumped = message.model_dump(mode="json", exclude={"params", "delta"})
        assert type(dumped["kind"]) is str and dumped["kind"] == kind.value
        assert json.loads(canonical_json(dumped))["kind"] == kind.value
        fields = canonical_fields(message)
        assert type(fields["kind"]) is str and fields["kind"] == kind.value


def test_participant_kinds_are_the_kinds_of_the_messages_a_participant_signs() -> None:
    signed = {k for k, m in one_of_each_kind().items() if isinstance(m, ParticipantMessage)}
    assert signed == PARTICIPANT_KINDS
    assert signed == {
        MessageKind.COMMITMENT,
        MessageKind.UPDATE,
        MessageKind.REFUSAL,
        MessageKind.UNMASK_RESPONSE,
        MessageKind.SURVIVOR_ATTESTATION,
    }


@pytest.mark.parametrize(
    "payload", [None, 3, "update", {}, {"kind": None}, {"kind": 3}, {"kind": "gradient"}]
)
def test_kind_of_names_no_kind_for_what_is_not_a_message(payload: Any) -> None:
    assert kind_of(payload) is None


def test_an_unknown_kind_is_refused_naming_the_kinds_as_they_are_spelled_on_the_wire() -> None:
    with pytest.raises(RoundError) as caught:
        from_wire(good_update(kind="gradient"))
    message = str(caught.value)
    assert message.startswith("malformed gradient: kind: gradient is not one of round-open, ")
    assert all(kind.value in message for kind in MessageKind)
    assert "MessageKind" not in message


# Computed before message kinds were typed (kind a Literal of strings): typing them must not
# move any digest a ledger, a manifest or a signature refers to. Re-pinned once, on purpose,
# when mask keys became per round (RoundOpen lost rekey/send_key_shares, Update key_shares
# for next_mask_key and an optional l2_norm, UnmaskResponse m_shares for pair_seeds), and
# once more when rounds took Flower's numbering (these messages moved from round 0 to 1).
# RoundOpen's alone moved again when it named the mask PRG (``secagg_prg``): no ledger,
# manifest or signature refers to a RoundOpen's digest. RoundClose's moved when it carried
# its round's C_t instead of the contributors' ids (their list is in the ledger record the
# close names); none of those refers to a RoundClose's digest either. UnmaskRequest's moved
# when it carried the attestations of the survivor set (none here): no ledger, manifest or
# signature refers to an UnmaskRequest's digest.
PINNED_DIGESTS = {
    MessageKind.ROUND_OPEN: (
        "2566b4fdbb75a3bf3814be45e259196280b8848c1cc02ae1c11c447cf01ba55b",
        None,
    ),
    MessageKind.COMMITMENT: (
        "bbcc27b14e324442be864b60a33903be228e7d9ff77337431faf4eedb6415de9",
        "d949d706618e65fae88492aabac2f758a72ae776e4fa7f2dd6dcca093a720135",
    ),
    MessageKind.UPDATE: (
        "d489761a5e32705356a216b8da32e583e636daa7d299c3403cc1a780bb8f1565",
        "bc3bf4ed84e0d200bc018ff918a117dcbf67cb52c3e402e423aaae58435bb229",
    ),
    MessageKind.REFUSAL: (
        "a1c55bd35c1011df634e702cc10c4e02e166feb1765a064fa8d48b764d0b9b34",
        "0ef2a706d408956dbe0ab90b283dc5264b90234979a69c3cb1734cd385610f4d",
    ),
    MessageKind.UNMASK_REQUEST: (
        "a1eed5abfb093ee5993edf6cf6d10f4e021455ffa804599b7513bd5a51891433",
        None,
    ),
    MessageKind.UNMASK_RESPONSE: (
        "dd1ad8f22e14c8235392e7f3723a413da647e075cd088821d6e2fb0a6ee6e138",
        "83be632ed36f3edbc5440c0436d1fe1fa12206130d86398addfb8b444304ec05",
    ),
    MessageKind.ROUND_CLOSE: (
        "9401861e8a821813bf9a19c3acceb686fd89fc40a9b89d82f9625d9e7f4b10eb",
        None,
    ),
    MessageKind.SURVIVOR_CHECK: (
        "2b52f7bc853544622fc55ecd02f22f54c09d9a69bd218c36a13872c62872d4f0",
        None,
    ),
    MessageKind.SURVIVOR_ATTESTATION: (
        "b89f6c503aefe6b9ee8bfac55fddf14170ebce33f12f8b08c89c67315b417df6",
        "f074e9842296e20571bd9e2e7bbcc68fc19002797c33ab8c00ad8d973cc964ea",
    ),
}


@pytest.mark.parametrize("kind", list(MessageKind), ids=lambda k: k.value)
def test_message_and_signing_digests_are_pinned(kind: MessageKind) -> None:
    message = one_of_each_kind()[kind]
    digest, signed = PINNED_DIGESTS[kind]
    assert message_digest(message) == digest
    assert message_digest(from_wire(to_wire(message))) == digest
    if isinstance(message, ParticipantMessage):
        assert signing_digest(message, 42) == signed
        assert signing_digest(message, 42, canonical_fields(message)) == signed
    else:
        assert signed is None
