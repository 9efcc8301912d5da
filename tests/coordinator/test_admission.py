"""The admission table, walked the way the transition table is: every (state, message type).

A pair without an entry is refused with IllegalMessage and changes nothing — neither the
attempt nor the registry; a pair with an entry reaches its handler.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from federation_helpers import small_config

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.coordinator.admission import (
    ADMISSION,
    PARTICIPANT_MESSAGES,
    Ingress,
    Verdict,
    admit,
    check_raw_plaintext,
)
from lensemble_flwr.coordinator.attempt import Attempt
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.coordinator.modes import MaskedMode, admission_tables
from lensemble_flwr.errors import (
    ConfigError,
    IllegalMessage,
    Response,
    UnalignableUpdate,
    response_to,
)
from lensemble_flwr.protocol.messages import (
    Commitment,
    ControlMessage,
    Refusal,
    RoundClose,
    RoundOpen,
    SurvivorAttestation,
    UnmaskRequest,
    UnmaskResponse,
    Update,
    to_wire,
)
from lensemble_flwr.protocol.round import RoundEvent, RoundState
from lensemble_flwr.simulations.toy import initial_params
from lensemble_flwr.transports.base import STOCK_CLIENTAPP

ROOT = "a" * 64
PROGRESS = [
    (RoundState.OPEN, None),
    (RoundState.COLLECTING, RoundEvent.QUORUM_REACHED),
    (RoundState.AGGREGATING, RoundEvent.COLLECTION_CLOSED),
    (RoundState.ALIGNING, RoundEvent.SUM_REPRODUCED),
    (RoundState.COMMITTING, RoundEvent.DIAGNOSED),
    (RoundState.CLOSED, RoundEvent.COMMITTED),
]
ALL_STATES = [*(s for s, _ in PROGRESS), RoundState.ABORTED]


def coordinator_in(tmp: Path, state: RoundState, **config: Any) -> Coordinator:
    """A coordinator (no transport) whose current attempt is in ``state``; p00 is bound."""
    coordinator = Coordinator(
        small_config(min_participants=1, **config),
        initial_params=initial_params(),
        store=Store(tmp / "run"),
        run_id="run",
    )
    attempt = coordinator.begin_attempt()
    coordinator.invite(["p00"])
    coordinator.registry.bind(commitment())
    if state is RoundState.ABORTED:
        attempt.machine.fire(RoundEvent.ABORT)
        return coordinator
    for reached, event in PROGRESS:
        if event is not None:
            attempt.machine.fire(event)
        if reached is state:
            return coordinator
    raise AssertionError(state)


def common(**changes: Any) -> dict[str, Any]:
    return {"run_id": "run", "round": 1, "attempt": 1, "sender": "p00", **changes}


def commitment() -> Commitment:
    return Commitment(**common(), participant_id="p00", dataset_root=ROOT, num_examples=8)


def messages() -> dict[type, ControlMessage]:
    """One valid message of every type, from p00, for round 0 attempt 1."""
    params = {n: np.asarray(a) for n, a in initial_params().items()}
    delta = {n: np.zeros_like(a, dtype=np.float32) for n, a in params.items()}
    mine = {**common(), "participant_id": "p00"}
    return {
        Commitment: commitment(),
        Update: Update(**mine, dataset_root=ROOT, delta=delta, l2_norm=0.0, num_examples=8),
        Refusal: Refusal(**mine, error="ProbeError", reason="probe differs"),
        UnmaskResponse: UnmaskResponse(**mine, b_shares={}, pair_seeds={}),
        RoundOpen: RoundOpen(
            **common(sender="p00"),
            global_hash="0" * 64,
            params=params,
            sketch_seed=1,
            h_steps=1,
        ),
        UnmaskRequest: UnmaskRequest(**common(), survivors=(), dropped=(), sealed={}),
        RoundClose: RoundClose(
            run_id="run",
            round=1,
            sender="p00",
            previous_hash="0" * 64,
            global_hash="1" * 64,
            count=0,
            record_hash="2" * 64,
        ),
    }


def ingress_of(coordinator: Coordinator) -> Ingress:
    return Ingress(
        config=coordinator.config,
        run_id=coordinator.run_id,
        registry=coordinator.registry,
        admitted_digests=lambda _round, _attempt: None,
    )


def snapshot(coordinator: Coordinator) -> dict[str, Any]:
    """Everything admission could change, as plain values."""
    attempt = coordinator.attempt
    assert attempt is not None
    fields = {
        f.name: copy.deepcopy(getattr(attempt, f.name))
        for f in dataclasses.fields(Attempt)
        if f.name not in ("machine", "state", "round_open", "aggregator", "transform")
    }
    return {
        **fields,
        "state": attempt.phase,
        "history": list(attempt.machine.history),
        "commitments": dict(coordinator.registry.commitments),
        "pending": getattr(attempt.aggregator, "pending_count", None),
    }


@pytest.mark.parametrize("message_type", list(messages()), ids=lambda t: t.__name__)
@pytest.mark.parametrize("state", ALL_STATES, ids=lambda s: s.value)
def test_every_state_and_message_type(tmp_path: Path, state: RoundState, message_type) -> None:
    coordinator = coordinator_in(tmp_path, state)
    attempt = coordinator.attempt
    assert attempt is not None and attempt.phase is state
    message = messages()[message_type]
    table = coordinator.mode.admission
    if (state, message_type) not in table:
        before = snapshot(coordinator)
        with pytest.raises(IllegalMessage, match=r"not admitted|may not send|admits no message"):
            admit(attempt, message, ingress_of(coordinator), table)
        assert snapshot(coordinator) == before  # nothing changed
        # through the coordinator's ingress, the same message is counted as rejected
        coordinator.receive(to_wire(message))
        after = snapshot(coordinator)
        assert after.pop("rejected") == before.pop("rejected") + 1
        assert after == before
    else:
        verdict = coordinator.receive(to_wire(message))
        expected = {
            Commitment: Verdict.BOUND,
            Refusal: Verdict.REFUSED,
            Update: Verdict.LATE if state is RoundState.AGGREGATING else Verdict.ADMITTED,
        }[message_type]
        assert verdict is expected


def test_the_tables_name_only_participant_messages_and_listening_states() -> None:
    listening = {RoundState.OPEN, RoundState.COLLECTING, RoundState.AGGREGATING}
    for table in admission_tables().values():
        assert {state for state, _ in table} <= listening
        assert {kind for _, kind in table} <= set(PARTICIPANT_MESSAGES)
    assert (RoundState.AGGREGATING, UnmaskResponse) not in ADMISSION  # plaintext: no unmask


def test_a_masked_round_admits_unmask_responses_only_while_aggregating(tmp_path: Path) -> None:
    masked = MaskedMode.admission
    assert [s for s, kind in masked if kind is UnmaskResponse] == [RoundState.AGGREGATING]
    assert [s for s, kind in masked if kind is SurvivorAttestation] == [RoundState.AGGREGATING]
    assert set(masked) == set(ADMISSION) | {
        (RoundState.AGGREGATING, UnmaskResponse),
        (RoundState.AGGREGATING, SurvivorAttestation),
    }


def test_an_update_a_handler_refuses_changes_nothing(tmp_path: Path) -> None:
    """The handler validates before it applies: an update bound to another root than its
    sender's commitment is refused with the attempt and the sum as they were."""
    coordinator = coordinator_in(tmp_path, RoundState.COLLECTING)
    good = messages()[Update]
    wrong = good.model_copy(update={"num_examples": 9})  # the commitment says 8
    before = snapshot(coordinator)
    assert coordinator.receive(to_wire(wrong)) is None
    after = snapshot(coordinator)
    assert after.pop("rejected") == before.pop("rejected") + 1 and after == before
    assert coordinator.receive(to_wire(good)) is Verdict.ADMITTED
    assert coordinator.attempt is not None and coordinator.attempt.admitted == {"p00"}


def test_a_message_of_another_attempt_is_filed_late_in_any_listening_state(
    tmp_path: Path,
) -> None:
    for i, state in enumerate((RoundState.OPEN, RoundState.COLLECTING, RoundState.AGGREGATING)):
        coordinator = coordinator_in(tmp_path / str(i), state)
        stale = messages()[Update].model_copy(update={"attempt": 7})
        assert coordinator.receive(to_wire(stale)) is Verdict.LATE
        assert coordinator.attempt is not None and coordinator.attempt.late == {"p00"}
        assert coordinator.attempt.admitted == set()


def test_each_mode_has_one_round_table_whose_exits_are_legal_transitions() -> None:
    """The flat views are the round tables' admission; every exit fires an event the
    round's transition table allows from that state; only OPEN and COLLECTING are left
    by ``advance``."""
    from lensemble_flwr.coordinator.admission import MASKED_ROUND, PLAINTEXT_ROUND, flat
    from lensemble_flwr.coordinator.modes import PlaintextMode
    from lensemble_flwr.protocol.round import TRANSITIONS

    for mode, table in ((PlaintextMode, PLAINTEXT_ROUND), (MaskedMode, MASKED_ROUND)):
        assert mode.table is table and dict(mode.admission) == dict(flat(table))
        exits = {state: phase.exit for state, phase in table.items() if phase.exit}
        assert set(exits) == {RoundState.OPEN, RoundState.COLLECTING}
        for state, rule in exits.items():
            assert (state, rule.event) in TRANSITIONS
    assert PLAINTEXT_ROUND[RoundState.OPEN].exit is MASKED_ROUND[RoundState.OPEN].exit


def test_a_round_table_that_contradicts_the_state_machine_is_refused() -> None:
    from lensemble_flwr.coordinator.admission import Phase, flat
    from lensemble_flwr.coordinator.exits import LEAVE_OPEN

    with pytest.raises(AssertionError):
        flat({RoundState.COLLECTING: Phase({}, LEAVE_OPEN)})  # QUORUM_REACHED from COLLECTING


def test_a_masked_round_without_an_unmask_exchange_is_refused_in_one_place() -> None:
    """``conclude_collected`` and a masked round's ``reveal`` refuse a missing unmask
    exchange through the same check (modes.require_exchange)."""
    from lensemble_flwr.coordinator.modes import require_exchange
    from lensemble_flwr.errors import ConfigError

    config = small_config(min_participants=2, secagg_threshold=2)
    mode = MaskedMode(config, None, "run")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unmask exchange"):
        require_exchange(mode, None)
    require_exchange(mode, lambda requests, done: None)  # an exchange: accepted


# -- what a coordinator-side transform may be given: raw plaintext deltas only ----------
def _plain_update(**fields: Any) -> Update:
    values = {
        "run_id": "r", "round": 1, "sender": "p01", "participant_id": "p01",
        "dataset_root": "a" * 64, "delta": {"w": np.ones(3, np.float32)}, "num_examples": 1,
        **fields,
    }  # fmt: skip
    return Update(**values)


@pytest.mark.parametrize(
    "transforms", [(), ("difference",), ("difference", "bind"), (STOCK_CLIENTAPP,)]
)
def test_a_raw_plaintext_update_may_be_transformed(transforms: tuple[str, ...]) -> None:
    check_raw_plaintext(_plain_update(transforms=transforms), "gauge-coordinator-harness")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (
            {
                "delta": {"w": np.ones(3, np.int8)},
                "scales": {"w": 0.5},
                "transforms": ("difference",),
            },
            "int8 scales",
        ),
        ({"transforms": ("difference", "int8_quantize", "bind")}, "'int8_quantize'"),
        ({"transforms": ("difference", "clip", "bind")}, "stage 'clip'"),
        ({"transforms": ("difference", "clip", "gaussian_noise")}, "'gaussian_noise'"),
        ({"epsilon": 0.5}, "epsilon 0.5"),
        ({"transforms": ("align", "difference")}, "stage 'align'"),
        ({"transforms": ("my_custom_stage",)}, "'my_custom_stage'"),
    ],
)
def test_a_release_transformed_update_is_refused_by_its_metadata(
    fields: dict[str, Any], named: str
) -> None:
    update = _plain_update(**fields)
    with pytest.raises(UnalignableUpdate, match=f"p01: update released with .*{named}") as info:
        check_raw_plaintext(update, "update_transform")
    assert info.value.field == "update_transform"
    assert isinstance(info.value, ConfigError)  # the specification's error for it
    assert response_to(info.value) is Response.REJECT_MESSAGE  # that update, not the run
