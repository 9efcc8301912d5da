"""Every scripted fault ends as specified and loses nothing that was committed."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from fault_scenarios import FAULT_ROUND, FAULTED_ROUND, SCENARIOS, Scenario, play
from federation_helpers import federation, small_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lensemble_flwr.protocol.messages import MessageKind
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import Ledger
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.transports.base import COORDINATOR


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_fault_scenario(scenario: Scenario, tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="lensemble_flwr.coordinator.coordinator"):
        observed = play(scenario, tmp_path)
    coordinator, expected = observed.coordinator, scenario.expected
    fault_round = FAULTED_ROUND.get(scenario.name, FAULT_ROUND)

    attempts = [e for e in coordinator.manifest.rounds if e.round == fault_round]
    assert tuple(e.state for e in attempts) == tuple(map(RoundState, expected.attempts))
    assert (type(observed.error).__name__ if observed.error else None) == expected.error
    last = attempts[-1]
    if expected.contributors is not None:
        assert last.contributors == expected.contributors
    if expected.rejected is not None:
        assert last.rejected == expected.rejected
    if expected.rejected_as is not None:
        rejections = [r.getMessage() for r in caplog.records if "rejected (" in r.getMessage()]
        assert rejections and all(f"({expected.rejected_as})" in r for r in rejections)
    if expected.late:  # a late update surfaces, and is dropped, in the next round
        coordinator.run(1)
        after = [e for e in coordinator.manifest.rounds if e.round == fault_round + 1][-1]
        assert set(expected.late) <= set(after.late) and after.count == 4

    # nothing committed was lost, nothing half-done is visible
    records = verify(coordinator.store)
    assert [r.record_hash for r in records[: len(observed.committed_before)]] == (
        observed.committed_before
    )
    head = Ledger(coordinator.store).head()
    assert head is not None and coordinator.global_state().params_hash == head.new_global_hash
    if RoundState(expected.attempts[-1]) is RoundState.ABORTED:
        assert coordinator.global_state().round == fault_round - 1  # the abort changed nothing
    else:
        assert coordinator.global_state().round == fault_round + bool(expected.late)


JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=80),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=8), st.integers(), max_size=3),
    st.just(np.full(3, np.inf, np.float32)),
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind=st.sampled_from(MessageKind),
    field=st.sampled_from(
        (
            "round",
            "attempt",
            "participant_id",
            "sender",
            "dataset_root",
            "delta",
            "l2_norm",
            "num_examples",
            "error",
            "reason",
            "b_shares",
            "params",
            "global_hash",
            "run_id",
            "signature",
            "identity_key",
            "transforms",
            "kind",
            "extra",
        )
    ),
    value=JUNK,
    drop=st.booleans(),
)
def test_malformed_messages_of_every_kind_change_nothing(
    tmp_path_factory, kind: MessageKind, field: str, value: object, drop: bool
) -> None:
    """A junk message of any kind, injected mid-round as if from p01, is rejected (or, if
    it happens to be a well-formed message, handled as one): never a crash, never a
    half-applied round."""
    tmp = tmp_path_factory.mktemp("malformed")
    coordinator, network, _ = federation(tmp, config=small_config())
    coordinator.run(1)
    base = {
        "kind": kind.value,
        "run_id": coordinator.run_id,
        "round": 2,
        "attempt": 1,
        "sender": "p01",
        "participant_id": "p01",
    }
    payload = dict(base)
    if drop:
        payload.pop(field, None)
    else:
        payload[field] = value
    network.inject("p01", COORDINATOR, payload)
    try:
        coordinator.run(1)
    except Exception as exc:  # only a typed, table-driven stop is acceptable
        from lensemble_flwr.errors import LensembleError

        assert isinstance(exc, LensembleError), exc
    assert coordinator.round_state() in (RoundState.CLOSED, RoundState.ABORTED)
    records = verify(coordinator.store)
    assert coordinator.global_state().params_hash == records[-1].new_global_hash
