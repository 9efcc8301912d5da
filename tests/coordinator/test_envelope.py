"""The envelope step (lensemble_flwr.coordinator.envelope) routes a message and writes
nothing: the late filing and every other write are the handlers' (admission.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lensemble_flwr.coordinator.envelope import Route, check_envelope
from lensemble_flwr.errors import ForgedMessage, IllegalMessage, RoundError
from lensemble_flwr.protocol.messages import Update
from lensemble_flwr.protocol.round import RoundState
from tests.coordinator.test_admission import coordinator_in, ingress_of, messages, snapshot


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
