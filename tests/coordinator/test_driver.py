"""The driver (lensemble_flwr.coordinator.driver): an attempt opened ahead is kept as an
explicit value — Delivered (continued by the next run_attempt) or EndedOnDelivery (its
outcome returned) — and consumed once."""

from __future__ import annotations

from pathlib import Path

import pytest
from federation_helpers import federation

from lensemble_flwr.coordinator.driver import Delivered, EndedOnDelivery
from lensemble_flwr.errors import FaultToleranceExceeded
from lensemble_flwr.protocol.round import RoundState


def test_an_attempt_opened_ahead_is_continued_once(tmp_path: Path) -> None:
    coordinator, _, _ = federation(tmp_path)
    coordinator.open_attempt()
    opened = coordinator._opened
    assert isinstance(opened, Delivered) and opened.attempt is coordinator.attempt
    outcome = coordinator.run_attempt()
    assert (outcome.round, outcome.attempt, outcome.state) == (1, 1, RoundState.CLOSED)
    assert coordinator._opened is None  # consumed: the next run_attempt begins anew
    assert coordinator.run_attempt().round == 2


def test_an_attempt_that_ended_as_it_was_delivered_hands_back_its_outcome(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    coordinator, network, _ = federation(tmp_path)

    def link_down(peer: str, message: object) -> None:
        raise FaultToleranceExceeded("the link is down")

    monkeypatch.setattr(network.coordinator, "send", link_down)
    coordinator.open_attempt()
    opened = coordinator._opened
    assert isinstance(opened, EndedOnDelivery)
    assert opened.outcome.state is RoundState.ABORTED
    assert coordinator.run_attempt() is opened.outcome
    assert coordinator._opened is None
