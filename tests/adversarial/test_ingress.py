"""Attacks on the coordinator's ingress: every message is admitted or rejected with a typed
error that changes nothing, and only a registered participant can stop a federation.

Each test reproduces an attack that worked before (issue 12, §2) and shows it now fails.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from federation_helpers import federation, signed_federation, small_config
from flwr.app import ConfigRecord
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.coordinator.admission import Verdict
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.errors import (
    FaultToleranceExceeded,
    LedgerError,
    LensembleError,
    Response,
    reported,
    response_to,
)
from lensemble_flwr.identity.signing import IdentityKey
from lensemble_flwr.protocol.messages import Commitment, MessageKind, Refusal, Update, to_wire
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.simulations.toy import initial_params
from lensemble_flwr.strategies import records
from lensemble_flwr.strategies.records import arrays_to_record
from lensemble_flwr.transports.base import (
    COORDINATOR,
    MALFORMED_REPLY,
    STOCK_CLIENTAPP,
    DeliveredFrom,
    FiledByTransport,
)
from tests.coordinator.test_admission import coordinator_in, messages, snapshot
from tests.strategies.test_grid_transport import _serverapp_identity  # noqa: F401  (autouse)
from tests.strategies.test_lensemble import stock_loop_federation

LISTENING = [RoundState.OPEN, RoundState.COLLECTING, RoundState.AGGREGATING]


def update_payload(**changes: Any) -> dict[str, Any]:
    """p00's valid update of round 0 attempt 1 (see test_admission), with ``changes``."""
    return {**to_wire(messages()[Update]), **changes}


# -- what only the coordinator's own transport may file ------------------------------------
@pytest.mark.parametrize(
    "payload",
    [
        # a transport files no other message than a refusal ...
        update_payload(),
        # ... and no refusal whose error would stop the federation
        to_wire(messages()[Refusal]) | {"error": "PrivacyBudgetExceeded"},
        to_wire(messages()[Refusal]),  # (ProbeError)
    ],
    ids=["update", "stopping-refusal", "other-refusal"],
)
def test_a_transport_files_nothing_but_its_own_refusals(
    tmp_path: Path, caplog, payload: dict[str, Any]
) -> None:
    coordinator = coordinator_in(tmp_path, RoundState.COLLECTING)
    before = snapshot(coordinator)
    assert coordinator.receive(FiledByTransport(payload)) is None
    assert "a transport files only refusals" in caplog.text
    after = snapshot(coordinator)
    assert after.pop("rejected") == before.pop("rejected") + 1 and after == before
    filed = FiledByTransport(to_wire(messages()[Refusal]) | {"error": MALFORMED_REPLY})
    assert coordinator.receive(filed) is not None  # what it may file is taken


def test_a_rejected_update_answers_for_its_node_only_when_it_is_that_nodes_own(
    tmp_path: Path, caplog
) -> None:
    """A delivered update that fails its signature is not proven to be the node's own
    (another node may have taken the name): it answers for nobody. Nor does a second,
    rejected update of a participant already admitted."""
    coordinator = coordinator_in(tmp_path, RoundState.COLLECTING, require_signatures=True)
    attempt = coordinator.attempt
    assert attempt is not None

    def delivered(payload: dict[str, Any]) -> DeliveredFrom:
        return DeliveredFrom(
            payload, peer="p00", round=attempt.round, attempt=attempt.number, node=5
        )

    assert coordinator.receive(delivered(update_payload())) is None
    assert "ForgedMessage" in caplog.text and not attempt.refused

    coordinator = coordinator_in(tmp_path / "b", RoundState.COLLECTING)
    attempt = coordinator.attempt
    assert attempt is not None
    assert coordinator.receive(delivered(update_payload())) is Verdict.ADMITTED
    assert coordinator.receive(delivered(update_payload())) is None  # a duplicate
    assert attempt.admitted == {"p00"} and not attempt.refused


def test_a_stock_reply_that_can_never_be_signed_answers_for_its_node(
    tmp_path: Path, caplog
) -> None:
    """Under ``require-signatures`` an update the transport made of a stock ClientApp's
    reply, from a participant with no key, is refused (ForgedMessage) and is that node's
    answer: nothing it sends can be signed, so the round does not wait for it. A
    participant with a registered key is still not answered for by an unsigned one."""
    coordinator = coordinator_in(tmp_path, RoundState.COLLECTING, require_signatures=True)
    attempt = coordinator.attempt
    assert attempt is not None
    stock = DeliveredFrom(
        update_payload(transforms=[STOCK_CLIENTAPP], dataset_root=None),
        peer="p00", round=attempt.round, attempt=attempt.number, node=5,
    )  # fmt: skip
    assert coordinator.receive(stock) is None
    assert "signatures required" in caplog.text
    assert list(attempt.refused) == ["p00"]
    assert attempt.refused["p00"].startswith("RejectedUpdate: ForgedMessage")

    key = IdentityKey.generate()
    keyed = coordinator_in(
        tmp_path / "b", RoundState.COLLECTING, require_signatures=True
    )
    keyed.registry.identities = {"p00": key.public_openssh}
    attempt = keyed.attempt
    assert attempt is not None
    assert keyed.receive(stock) is None
    assert not attempt.refused  # p00 has a key: an unsigned update is nobody's answer


def test_a_transport_refusal_with_nothing_left_to_stop_is_dropped(tmp_path: Path) -> None:
    """A refusal the transport files for a participant already admitted (a SuperLink error
    arriving after its update), or for another attempt, is dropped: not recorded as a
    refusal, not filed as late (it is nobody's signed word)."""
    coordinator = coordinator_in(tmp_path, RoundState.COLLECTING)
    attempt = coordinator.attempt
    assert attempt is not None
    assert coordinator.receive(update_payload()) is Verdict.ADMITTED
    refusal = to_wire(messages()[Refusal]) | {"error": MALFORMED_REPLY}
    assert coordinator.receive(FiledByTransport(refusal)) is Verdict.LATE
    other = refusal | {"attempt": attempt.number + 1}
    assert coordinator.receive(FiledByTransport(other)) is Verdict.LATE
    assert not attempt.refused and not attempt.late and attempt.admitted == {"p00"}


def test_a_rejection_after_collection_closed_answers_for_nobody(tmp_path: Path) -> None:
    """Once the round aggregates, nobody is waited for: a delivered update rejected then
    changes no participant's answer."""
    coordinator = coordinator_in(tmp_path, RoundState.AGGREGATING)
    attempt = coordinator.attempt
    assert attempt is not None
    junk = DeliveredFrom(
        update_payload(l2_norm=math.inf), peer="p00", round=attempt.round,
        attempt=attempt.number, node=5,
    )  # fmt: skip
    assert coordinator.receive(junk) is None
    assert attempt.rejected == 1 and not attempt.refused


# -- non-finite floats ------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes",
    [
        {"epsilon": math.inf},
        {"epsilon": math.nan},
        {"l2_norm": math.inf},
        {"scales": {"w": math.inf}},
    ],
    ids=["epsilon-inf", "epsilon-nan", "l2-inf", "scale-inf"],
)
def test_a_non_finite_float_in_any_field_is_rejected_not_a_crash(
    tmp_path: Path, caplog, changes: dict
) -> None:
    """It used to crash the coordinator (canonical JSON refuses NaN and infinity) before
    its signature was checked: a permanent denial of service, resent every round."""
    coordinator = coordinator_in(tmp_path, RoundState.COLLECTING)
    before = snapshot(coordinator)
    assert coordinator.receive(update_payload(**changes)) is None
    assert "rejected (RoundError)" in caplog.text and untyped_rejections(caplog) == []
    after = snapshot(coordinator)
    assert after.pop("rejected") == before.pop("rejected") + 1 and after == before


def test_a_non_finite_epsilon_changes_nothing_in_a_signed_federation_either(
    tmp_path: Path,
) -> None:
    keys = {f"p0{i}": IdentityKey.generate() for i in range(4)}
    coordinator, network, _ = signed_federation(tmp_path, keys)
    coordinator.run(1)
    bad = {**update_payload(), "run_id": coordinator.run_id, "round": 2, "epsilon": math.inf}
    network.inject("p01", COORDINATOR, bad)
    coordinator.run(1)
    last = coordinator.outcomes[-1]
    assert last.state is RoundState.CLOSED and last.count == 4 and last.rejected >= 1
    verify(coordinator.store)


def test_a_non_finite_epsilon_on_the_flower_reply_path_is_rejected(tmp_path: Path) -> None:
    strategy, grid = stock_loop_federation(tmp_path)
    arrays = arrays_to_record(initial_params())
    instructions = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    replies = grid.send_and_receive(instructions)
    forged = replies[0]
    payloads = records.decode_reply(forged.content)
    for p in payloads:
        if p.get("kind") == MessageKind.UPDATE.value:
            p["epsilon"] = math.inf
    forged.content = records.encode_reply(payloads, {})
    new, metrics = strategy.aggregate_train(1, replies)
    assert new is not None and metrics is not None
    assert metrics["lensemble.C_t"] == 3.0 and metrics["lensemble.rejected"] == 1.0


# -- refusals ---------------------------------------------------------------------------
def test_a_refusal_naming_an_error_with_a_structured_constructor_is_rebuilt() -> None:
    """`UnreadableDocument(what, detail, message)` used to make the rebuild raise
    TypeError inside the coordinator; it is rebuilt as its nearest plain ancestor, with
    the same response."""
    error = reported("UnreadableDocument", "p01: the manifest is unreadable")
    assert isinstance(error, LedgerError) and response_to(error) is Response.STOP_FEDERATION
    assert "p01" in str(error)
    assert reported("RoundIncomplete", "x") is not None  # takes keyword fields too
    assert reported("NoSuchError", "x") is None


@pytest.mark.parametrize("error", ["PrivacyBudgetExceeded", "LedgerError", "ConfigError"])
def test_nobody_unregistered_can_stop_the_federation(tmp_path: Path, error: str) -> None:
    """An unsigned Refusal from an id that never joined used to stop the whole federation
    (trust on first use). Now it is refused at ingress, and the round closes."""
    coordinator, network, _ = federation(tmp_path)
    coordinator.run(1)
    intruder = {
        "kind": MessageKind.REFUSAL.value,
        "run_id": coordinator.run_id,
        "round": 2,
        "attempt": 1,
        "sender": "mallory",
        "participant_id": "mallory",
        "error": error,
        "reason": "stop everything",
    }
    network.inject("mallory", COORDINATOR, intruder)
    coordinator.run(1)
    last = coordinator.outcomes[-1]
    assert last.state is RoundState.CLOSED and last.count == 4 and last.rejected == 1
    assert "mallory" not in coordinator.manifest.rounds[-1].refused


def test_an_invited_but_unregistered_participant_cannot_stop_the_federation(
    tmp_path: Path,
) -> None:
    """Invited, but never bound: its Refusal is recorded, and stops nothing."""
    coordinator = coordinator_in(tmp_path, RoundState.COLLECTING)
    assert coordinator.attempt is not None
    coordinator.attempt.invited.add("p09")
    refusal = {
        "kind": MessageKind.REFUSAL.value,
        "run_id": "run",
        "round": 1,
        "attempt": 1,
        "sender": "p09",
        "participant_id": "p09",
        "error": "PrivacyBudgetExceeded",
        "reason": "spent",
    }
    assert coordinator.receive(refusal) is not None  # recorded, not raised
    assert "p09" in coordinator.attempt.refused
    # the same from a registered participant stops the federation, as the table says
    with pytest.raises(LensembleError) as stop:
        coordinator.receive({**refusal, "sender": "p00", "participant_id": "p00"})
    assert response_to(stop.value) is Response.STOP_FEDERATION


# -- contradicting flags, unauthenticated late messages -----------------------------------
def test_a_masked_update_is_not_admitted_into_a_plaintext_round(tmp_path: Path) -> None:
    """A signed update saying masked=true bypassed max-abs-update in a plaintext round."""
    coordinator = coordinator_in(tmp_path, RoundState.COLLECTING)
    huge = {name: np.full(np.shape(a), 7 * 10**8, np.int64) for name, a in initial_params().items()}
    masked = update_payload(masked=True, delta=huge, sealed_shares={"p00": "00"})
    before = snapshot(coordinator)
    assert coordinator.receive(masked) is None
    after = snapshot(coordinator)
    assert after.pop("rejected") == before.pop("rejected") + 1 and after == before


def test_a_late_message_is_filed_only_when_authenticated(tmp_path: Path) -> None:
    """Messages of another round reached the manifest's `late` list unauthenticated."""
    keys = {f"p0{i}": IdentityKey.generate() for i in range(4)}
    coordinator, network, _ = signed_federation(tmp_path, keys)
    coordinator.run(2)
    stale = {**update_payload(), "run_id": coordinator.run_id, "round": 1}
    network.inject("p01", COORDINATOR, stale)  # unsigned, but p01 has a registered key
    stranger = {**stale, "sender": "mallory", "participant_id": "mallory"}
    network.inject("mallory", COORDINATOR, stranger)
    coordinator.run(1)
    entry = coordinator.manifest.rounds[-1]
    # p01's forgery is rejected; the stranger's is dropped unrecorded (a late message of
    # an unknown sender is nobody's business, and writes nothing to the manifest)
    assert entry.state is RoundState.CLOSED and entry.rejected == 1
    assert "p01" not in entry.late and "mallory" not in entry.late


# -- the guard: nothing escapes ---------------------------------------------------------
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.lists(st.one_of(st.integers(), st.text(max_size=4)), max_size=3),
    st.dictionaries(st.text(max_size=6), st.one_of(st.integers(), st.floats()), max_size=3),
    st.just(np.full(3, np.inf, np.float32)),
    st.just(np.zeros((2, 2), np.int64)),
)
SENDERS = st.sampled_from(["p00", "p01", "mallory", ""])
FIELDS = [
    *("round", "attempt", "sender", "participant_id", "dataset_root", "delta", "l2_norm"),
    *("num_examples", "epsilon", "scales", "masked", "sealed_shares", "next_mask_key"),
    *("sketch_fingerprint", "transforms", "error", "reason", "b_shares", "pair_seeds"),
    *("mask_key", "enc_key", "identity_key", "signature", "run_id", "kind", "params"),
    *("global_hash", "contributors"),
]


def untyped_rejections(caplog) -> list[str]:
    """Rejections by the last-resort guard (an untyped error): each one is a bug."""
    return [r.getMessage() for r in caplog.records if "untyped error" in r.getMessage()]


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    state=st.sampled_from(LISTENING),
    kind=st.sampled_from(sorted(messages(), key=lambda t: t.__name__)),
    field=st.sampled_from(FIELDS),
    value=JUNK,
    sender=SENDERS,
    shift=st.sampled_from([(0, 0), (0, 1), (1, 0), (-1, 0)]),
)
def test_every_message_is_admitted_or_rejected_and_nothing_escapes(
    tmp_path_factory, caplog, state, kind, field, value, sender, shift
) -> None:
    """A valid message of every type, with one field replaced by junk, from any sender,
    for this or another round or attempt, in every state that listens: admitted, or
    rejected with a typed error (never by the last-resort guard) that changed nothing."""
    caplog.clear()
    coordinator = coordinator_in(tmp_path_factory.mktemp("fuzz"), state)
    payload = dict(to_wire(messages()[kind]))
    payload[field] = value
    if "participant_id" in payload and field not in ("sender", "participant_id"):
        payload["sender"] = payload["participant_id"] = sender
    if field != "round":
        payload["round"] = max(0, payload["round"] + shift[0])
    if field != "attempt" and "attempt" in payload:
        payload["attempt"] = max(1, payload["attempt"] + shift[1])
    before = snapshot(coordinator)
    try:
        verdict = coordinator.receive(payload)
    except LensembleError as exc:
        # only a registered participant's word may stop the round (authenticated by its
        # signature where it registered a key; without keys, the transport's sender
        # identity is what is trusted: docs/threat-model.md)
        assert response_to(exc) is not Response.REJECT_MESSAGE
        assert payload.get("participant_id") == "p00"  # the only registered one
        return
    after = snapshot(coordinator)
    assert untyped_rejections(caplog) == []
    if verdict is None:  # rejected: counted, and nothing else changed
        assert after.pop("rejected") == before.pop("rejected") + 1
        assert after == before
    else:
        assert after["rejected"] == before["rejected"]


class ValueErrorAggregator:
    """An aggregator with a bug: admitting anything raises an untyped error."""

    def __init__(self, *_args: object, **_kwargs: object) -> None:
        pass

    def admit(self, update: object, *, weight: int) -> None:
        raise ValueError("a bug below admission")


def test_the_last_resort_guard_rejects_an_untyped_error_and_logs_it(tmp_path: Path, caplog) -> None:
    coordinator = Coordinator(
        small_config(min_participants=1),
        initial_params=initial_params(),
        store=Store(tmp_path / "run"),
        run_id="run",
        aggregator_factory=lambda *_: ValueErrorAggregator(),  # type: ignore[arg-type,return-value]
    )
    coordinator.begin_attempt()
    coordinator.invite(["p00"])
    coordinator.registry.bind(messages()[Commitment])  # type: ignore[arg-type]
    assert coordinator.receive(update_payload()) is None
    assert coordinator.attempt is not None and coordinator.attempt.rejected == 1
    assert untyped_rejections(caplog) and "a bug below admission" in caplog.text


def test_the_outcomes_refusals_are_only_the_invited_participants_that_did_not_contribute(
    tmp_path: Path,
) -> None:
    """``RoundOutcome.refused`` (``lensemble.refused``): a participant whose update was
    admitted and that then sends a refusal contributed; it is not counted as refused."""
    coordinator = coordinator_in(tmp_path, RoundState.COLLECTING)
    assert coordinator.receive(update_payload()) is Verdict.ADMITTED
    coordinator.receive(to_wire(messages()[Refusal]))  # p00 again, after its update
    assert coordinator.attempt is not None and "p00" in coordinator.attempt.refused
    outcome = coordinator.abort(FaultToleranceExceeded("stopped here"))
    assert outcome.refused == ()
