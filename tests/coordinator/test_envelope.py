"""The envelope step (lensemble_flwr.coordinator.envelope) routes a message and writes
nothing: the late filing and every other write are the handlers' (admission.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from federation_helpers import small_config

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.coordinator.envelope import Route, check_envelope
from lensemble_flwr.errors import ForgedMessage, IllegalMessage, RoundError
from lensemble_flwr.identity.signing import IdentityKey
from lensemble_flwr.protocol.messages import RoundOpen, Update, to_wire
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.simulations.toy import initial_params
from lensemble_flwr.transports.base import DeliveredFrom
from tests.coordinator.test_admission import (
    commitment,
    coordinator_in,
    ingress_of,
    messages,
    snapshot,
)


def test_the_envelope_routes_without_writing(tmp_path: Path) -> None:
    coordinator = coordinator_in(tmp_path, RoundState.COLLECTING)
    attempt = coordinator.attempt
    assert attempt is not None
    ingress = ingress_of(coordinator)
    good = messages()[Update]
    before = snapshot(coordinator)
    route, fields = check_envelope(attempt, good, ingress, True)
    assert route is Route.CURRENT and fields
    stale = good.model_copy(update={"attempt": 7})
    assert check_envelope(attempt, stale, ingress, True)[0] is Route.LATE
    unknown = good.model_copy(update={"participant_id": "p99", "sender": "p99", "attempt": 7})
    assert check_envelope(attempt, unknown, ingress, True)[0] is Route.DROPPED
    assert snapshot(coordinator) == before  # nothing written, late or not


@pytest.mark.parametrize(
    ("change", "listening", "error", "match"),
    [
        ({}, False, IllegalMessage, "admits no message"),
        ({"run_id": "other"}, True, RoundError, "message of run"),
        ({"participant_id": "p99", "sender": "p99"}, True, ForgedMessage, "neither invited"),
    ],
)
def test_the_envelope_refuses_and_writes_nothing(
    tmp_path: Path, change: dict, listening: bool, error: type, match: str
) -> None:
    coordinator = coordinator_in(tmp_path, RoundState.OPEN)
    attempt = coordinator.attempt
    assert attempt is not None
    before = snapshot(coordinator)
    with pytest.raises(error, match=match):
        check_envelope(
            attempt, messages()[Update].model_copy(update=change), ingress_of(coordinator),
            listening,
        )  # fmt: skip
    assert snapshot(coordinator) == before


def keyed_coordinator(tmp: Path, key: IdentityKey, **config: Any) -> Coordinator:
    """A coordinator whose allow-list names p00 with ``key``, in an open attempt."""
    coordinator = Coordinator(
        small_config(min_participants=1, **config),
        initial_params=initial_params(),
        store=Store(tmp / "run"),
        run_id="run",
        identities={"p00": key.public_openssh},
    )
    coordinator.begin_attempt()
    coordinator.invite(["p00"])
    return coordinator


def test_a_name_is_proven_only_by_the_key_registered_for_it(tmp_path: Path) -> None:
    """What a transport asks before it binds a node to the name its reply claims: signed
    by the name's allow-listed key, and nothing else (another key, no signature, another
    run, a name off the list, a payload that is not a message). Nothing changes."""
    key, other = IdentityKey.generate(), IdentityKey.generate()
    before = Coordinator(
        small_config(min_participants=1),
        initial_params=initial_params(),
        store=Store(tmp_path / "before"),
        run_id="run",
    )
    update = messages()[Update]
    assert not before.proves_name(to_wire(update))  # no attempt yet: nothing is proven
    coordinator = keyed_coordinator(tmp_path, key)
    attempt = coordinator.attempt
    assert attempt is not None
    seed = attempt.state.sketch_seed
    seen = snapshot(coordinator)
    assert coordinator.proves_name(to_wire(key.sign(update, seed)))
    assert not coordinator.proves_name(to_wire(other.sign(update, seed)))
    assert not coordinator.proves_name(to_wire(update))  # unsigned
    assert not coordinator.proves_name(to_wire(key.sign(update, seed + 1)))  # another seed
    another_run = update.model_copy(update={"run_id": "other"})
    assert not coordinator.proves_name(to_wire(key.sign(another_run, seed)))
    unlisted = update.model_copy(update={"participant_id": "p01", "sender": "p01"})
    assert not coordinator.proves_name(to_wire(key.sign(unlisted, seed)))
    assert not coordinator.proves_name({"kind": "update", "sender": "p00"})  # malformed
    assert not coordinator.proves_name(to_wire(messages()[RoundOpen]))  # not a participant's
    assert snapshot(coordinator) == seen


def test_without_a_key_for_the_name_the_first_claim_proves_it(tmp_path: Path) -> None:
    """No allow-list, no key bound for the name and no signature required: an unsigned
    message proves its name (first come), and a first commitment proves it with the key
    it registers; once the key is bound, only that key does."""
    coordinator = Coordinator(
        small_config(min_participants=1),
        initial_params=initial_params(),
        store=Store(tmp_path / "run"),
        run_id="run",
    )
    attempt = coordinator.begin_attempt()
    seed = attempt.state.sketch_seed
    key, other = IdentityKey.generate(), IdentityKey.generate()
    assert coordinator.proves_name(to_wire(messages()[Update]))
    first = commitment().model_copy(update={"identity_key": key.public_openssh})
    assert coordinator.proves_name(to_wire(key.sign(first, seed)))
    coordinator.registry.bind(first)
    assert coordinator.proves_name(to_wire(key.sign(messages()[Update], seed)))
    assert not coordinator.proves_name(to_wire(other.sign(messages()[Update], seed)))
    assert not coordinator.proves_name(to_wire(messages()[Update]))  # bound with a key


def test_a_forged_update_delivered_from_a_node_under_another_name_ends_its_wait(
    tmp_path: Path,
) -> None:
    """An update a transport delivered from node-11 in p00's name, not signed by p00's
    key: rejected as forged, and node-11 answered (it is refused this attempt, under its
    own address); p00 still may answer. The same update delivered from p00's own node
    answers for nobody (another node may have taken the name)."""
    key, other = IdentityKey.generate(), IdentityKey.generate()
    coordinator = keyed_coordinator(tmp_path, key)
    attempt = coordinator.attempt
    assert attempt is not None
    coordinator.invite(["node-11"])
    coordinator.registry.bind(commitment())
    forged = to_wire(other.sign(messages()[Update], attempt.state.sketch_seed))
    from_p00 = DeliveredFrom(forged, peer="p00", round=1, attempt=1, node=12)
    assert coordinator.receive(from_p00) is None
    assert attempt.rejected == 1 and not attempt.refused
    from_11 = DeliveredFrom(forged, peer="node-11", round=1, attempt=1, node=11)
    assert coordinator.receive(from_11) is None
    assert attempt.rejected == 2 and list(attempt.refused) == ["node-11"]
    assert "ForgedMessage" in attempt.refused["node-11"]
    signed = to_wire(key.sign(messages()[Update], attempt.state.sketch_seed))
    assert coordinator.receive(DeliveredFrom(signed, peer="p00", round=1, attempt=1, node=12))
    assert attempt.admitted == {"p00"}
