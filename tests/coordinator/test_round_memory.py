"""What a coordinator and its participants keep between rounds: the latest outcomes only
(the manifest has the rest), and one validated RoundClose per broadcast, not one per
recipient."""

from __future__ import annotations

from pathlib import Path

import pytest

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator import create as create_module
from lensemble_flwr.coordinator.attempt import RoundOutcome
from lensemble_flwr.coordinator.outcomes import KEEP_OUTCOMES, RecentOutcomes
from lensemble_flwr.errors import OutcomeForgotten, RoundError
from lensemble_flwr.protocol import messages
from lensemble_flwr.protocol.messages import RoundClose, UnmaskRequest, from_wire, to_wire
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.simulations.inprocess import build
from lensemble_flwr.transports.base import COORDINATOR

H = "ab" * 32


def _outcome(n: int) -> RoundOutcome:
    return RoundOutcome(
        round=n, attempt=1, state=RoundState.CLOSED, error=None, count=0, contributors=(),
        late=(), rejected=0, global_hash=H, diagnostics={}, elapsed=0.0,
    )  # fmt: skip


# -- RecentOutcomes ------------------------------------------------------------------
def test_recent_outcomes_number_every_outcome_and_keep_the_latest() -> None:
    kept = RecentOutcomes(3)
    assert len(kept) == 0 and kept == [] and kept.first == 0
    for n in range(1, 6):
        kept.append(_outcome(n))
    assert len(kept) == 5 and kept.first == 2 and len(kept._kept) == 3
    assert kept[-1].round == 5 and kept[2].round == 3 and kept[-3].round == 3
    assert [o.round for o in kept[2:]] == [3, 4, 5] and [o.round for o in kept[4:]] == [5]
    assert kept[5:] == [] and bool(kept)


@pytest.mark.parametrize("read", [lambda k: k[1], lambda k: k[-4], lambda k: k[1:], list])
def test_a_forgotten_outcome_is_a_typed_error(read) -> None:  # type: ignore[no-untyped-def]
    kept = RecentOutcomes(3)
    for n in range(1, 6):
        kept.append(_outcome(n))
    with pytest.raises(OutcomeForgotten, match="run manifest"):
        read(kept)


def test_positions_past_the_end_are_an_index_error() -> None:
    kept = RecentOutcomes(2)
    kept.append(_outcome(1))
    with pytest.raises(IndexError, match="out of range"):
        kept[1]
    with pytest.raises(IndexError, match="out of range"):
        kept[-2]


def test_recent_outcomes_compare_with_lists_only_when_nothing_is_forgotten() -> None:
    a, b = RecentOutcomes(2), RecentOutcomes(2)
    for n in (1, 2):
        a.append(_outcome(n))
        b.append(_outcome(n))
    assert a == [_outcome(1), _outcome(2)] and a == b and a != [_outcome(1)]
    a.append(_outcome(3))
    assert a != [_outcome(2), _outcome(3)] and a != b
    b.append(_outcome(3))
    assert a == b


def test_keeping_no_outcome_is_refused() -> None:
    with pytest.raises(ValueError, match="keep must be >= 1"):
        RecentOutcomes(0)


def _config(**federation: object) -> LensembleConfig:
    fed = {"min_participants": 2, "open_timeout": 10.0, "collect_timeout": 10.0, **federation}
    return LensembleConfig(federation=fed, inner={"steps": 1, "batch_size": 4})


def test_the_coordinator_keeps_a_bounded_number_of_outcomes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(create_module, "KEEP_OUTCOMES", 2)
    config = _config(max_round_attempts=2)
    coordinator, network, _ = build(config, tmp_path / "run", participants=2)
    coordinator.run(4)
    network.flush()
    outcomes = coordinator.outcomes
    assert len(outcomes) == 4 and len(outcomes._kept) == 2
    assert [o.round for o in outcomes[2:]] == [3, 4]
    with pytest.raises(OutcomeForgotten):
        outcomes[1]
    stored = coordinator.manifest.rounds  # every attempt, from the store
    assert [e.round for e in stored] == [1, 2, 3, 4]
    assert outcomes[-1].contributors == stored[-1].contributors == ("p00", "p01")


def test_a_round_may_have_more_attempts_than_the_default_keeps(tmp_path: Path) -> None:
    config = _config(max_round_attempts=KEEP_OUTCOMES + 4)
    coordinator, _, _ = build(config, tmp_path / "run", participants=2)
    assert coordinator.outcomes._kept.maxlen == KEEP_OUTCOMES + 4


# -- from_wire: one validation per broadcast payload ---------------------------------
def _close(count: int) -> dict:
    close = RoundClose(
        run_id="r", round=1, sender=COORDINATOR, previous_hash=H, global_hash=H,
        count=count, record_hash=H,
    )  # fmt: skip
    return to_wire(close)


def test_the_same_immutable_payload_is_validated_once(monkeypatch: pytest.MonkeyPatch) -> None:
    payload = _close(2)
    first = from_wire(payload)
    calls: list[object] = []
    real = messages._ADAPTER.validate_python
    counting = type("A", (), {"validate_python": lambda _, v: calls.append(v) or real(v)})
    monkeypatch.setattr(messages, "_ADAPTER", counting())
    assert from_wire(payload) is first and from_wire(dict(payload)) is first and calls == []
    # equal but not the same objects: validated again, to an equal message
    again = from_wire({**payload, "global_hash": "".join(list(H))})
    assert again == first and again is not first and len(calls) == 1


def test_a_payload_with_a_mutable_value_is_validated_every_time() -> None:
    request = UnmaskRequest(
        run_id="r", round=1, sender=COORDINATOR, survivors=("p0",), dropped=(), sealed={}
    )
    # what the memo may keep: scalars and tuples of them, never a container that can change
    assert messages._immutable(("p0", 1, None)) and messages._immutable("p0")
    assert not messages._immutable(["p0"]) and not messages._immutable({})
    assert not messages._immutable(("p0", []))
    payload = {**to_wire(request), "survivors": ["p0"]}  # a list could change
    assert from_wire(payload).survivors == ("p0",)
    payload["survivors"].append(7)  # type: ignore[attr-defined]
    with pytest.raises(RoundError, match="survivors"):
        from_wire(payload)


def test_a_changed_field_is_validated_afresh() -> None:
    payload = _close(1)
    from_wire(payload)
    with pytest.raises(RoundError, match="global_hash"):
        from_wire({**payload, "global_hash": "not hex"})
    with pytest.raises(RoundError, match="surplus"):
        from_wire({**payload, "surplus": 1})


def test_every_participant_holds_the_one_round_close_of_a_broadcast(tmp_path: Path) -> None:
    coordinator, network, nodes = build(_config(), tmp_path / "run", participants=3)
    coordinator.run(1)
    network.flush()
    closes = {id(n.last_close) for n in nodes}
    assert len(closes) == 1 and nodes[0].last_close == coordinator.last_close


# -- the in-process network remembers the latest round's opened attempts only -----------
def test_the_network_remembers_only_the_latest_rounds_opened_attempts(tmp_path: Path) -> None:
    coordinator, network, _ = build(_config(), tmp_path / "run", participants=2)
    coordinator.run(3)
    network.flush()
    assert network._opened == {(3, 1)}


def test_an_earlier_rounds_round_open_applies_no_scripted_fault_again(tmp_path: Path) -> None:
    coordinator, network, _ = build(_config(), tmp_path / "run", participants=3)
    coordinator.run(2)
    network.faults.drop("p02", round=1, at=RoundState.OPEN)  # scripted for a past round
    stale = to_wire(coordinator.core.round_open(1).model_copy(update={"round": 1, "attempt": 2}))
    network.inject(COORDINATOR, "p00", stale)
    network.flush()
    assert "p02" in network.online() and network._opened == {(2, 1)}
    network.faults.drop("p02", round=3, at=RoundState.OPEN)
    coordinator.run(1)
    assert "p02" not in network.online() and network._opened == {(3, 1)}
