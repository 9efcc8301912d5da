"""Tests of the round state machine, the type of a round's terminal state (in memory and
in stored manifests and outcomes), and the pinned global state."""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import get_args

import numpy as np
import pytest
from pydantic import ValidationError

from lensemble_flwr.canonical import canonical_json, digest_arrays
from lensemble_flwr.errors import CheckpointIntegrityError, IllegalTransition
from lensemble_flwr.protocol.round import (
    TERMINAL_STATES,
    TRANSITIONS,
    RoundEvent,
    RoundMachine,
    RoundState,
    TerminalState,
    next_state,
    transition_diagram,
)
from lensemble_flwr.protocol.state import GlobalState
from lensemble_flwr.provenance.ledger import (
    RoundEntry,
    RunManifest,
    UnreadableDocument,
    parse_document,
)
from lensemble_flwr.provenance.summary import AttemptSummary
from lensemble_flwr.shared_folder.records import Outcome, decode_outcome, encode

S, E = RoundState, RoundEvent

HAPPY_PATH = [
    (E.QUORUM_REACHED, S.COLLECTING),
    (E.COLLECTION_CLOSED, S.AGGREGATING),
    (E.SUM_REPRODUCED, S.ALIGNING),
    (E.DIAGNOSED, S.COMMITTING),
    (E.COMMITTED, S.CLOSED),
]
NON_TERMINAL = [s for s in RoundState if s not in TERMINAL_STATES]
ILLEGAL = [
    (s, e) for s, e in itertools.product(RoundState, RoundEvent) if (s, e) not in TRANSITIONS
]


def _machine_in(state: RoundState) -> RoundMachine:
    """A machine driven to ``state`` through legal events only."""
    m = RoundMachine(round=4)
    if state is S.ABORTED:
        m.fire(E.ABORT, reason="test")
        return m
    for event, target in HAPPY_PATH:
        if m.state is state:
            break
        m.fire(event)
        assert m.state is target
    assert m.state is state
    return m


def test_happy_path_through_every_progress_state() -> None:
    m = RoundMachine(round=1)
    assert m.state is S.OPEN and m.history == [] and m.attempt == 1
    visited = [m.state]
    for event, target in HAPPY_PATH:
        assert m.fire(event) is target
        assert m.state is target
        visited.append(m.state)
    assert visited == [S.OPEN, S.COLLECTING, S.AGGREGATING, S.ALIGNING, S.COMMITTING, S.CLOSED]
    assert m.history == [
        (S.OPEN, E.QUORUM_REACHED, S.COLLECTING),
        (S.COLLECTING, E.COLLECTION_CLOSED, S.AGGREGATING),
        (S.AGGREGATING, E.SUM_REPRODUCED, S.ALIGNING),
        (S.ALIGNING, E.DIAGNOSED, S.COMMITTING),
        (S.COMMITTING, E.COMMITTED, S.CLOSED),
    ]
    assert m.abort_reason is None


@pytest.mark.parametrize("state", NON_TERMINAL, ids=lambda s: s.value)
def test_abort_is_legal_from_every_non_terminal_state(state: RoundState) -> None:
    m = _machine_in(state)
    depth = len(m.history)
    assert m.fire(E.ABORT, reason="quorum lost") is S.ABORTED
    assert m.state is S.ABORTED
    assert m.abort_reason == "quorum lost"
    assert m.history[depth:] == [(state, E.ABORT, S.ABORTED)]


def test_illegal_pairs_are_enumerated() -> None:
    # 7 states x 6 events, 10 of them legal.
    assert len(ILLEGAL) == len(RoundState) * len(RoundEvent) - len(TRANSITIONS) == 32


@pytest.mark.parametrize(("state", "event"), ILLEGAL, ids=lambda x: x.value)
def test_every_illegal_pair_raises_and_changes_nothing(
    state: RoundState, event: RoundEvent
) -> None:
    m = _machine_in(state)
    history = list(m.history)
    reason = m.abort_reason
    with pytest.raises(
        IllegalTransition, match=f"no transition from '{state.value}' on '{event.value}'"
    ):
        m.fire(event, reason="ignored")
    assert m.state is state
    assert m.history == history
    assert m.abort_reason == reason
    with pytest.raises(IllegalTransition):
        next_state(state, event)


@pytest.mark.parametrize("state", sorted(TERMINAL_STATES), ids=lambda s: s.value)
def test_terminal_states_have_no_outgoing_transitions(state: RoundState) -> None:
    assert not [pair for pair in TRANSITIONS if pair[0] is state]
    m = _machine_in(state)
    for event in RoundEvent:
        with pytest.raises(IllegalTransition):
            m.fire(event)
    assert m.state is state


def test_every_non_terminal_state_is_reachable_and_can_progress() -> None:
    sources = {s for s, _ in TRANSITIONS}
    targets = set(TRANSITIONS.values())
    assert sources == set(NON_TERMINAL)
    assert targets | {S.OPEN} == set(RoundState)


def test_transition_diagram_mentions_every_transition() -> None:
    diagram = transition_diagram()
    lines = diagram.splitlines()
    assert lines[0] == "stateDiagram-v2"
    assert "    [*] --> OPEN" in lines
    for (source, event), target in TRANSITIONS.items():
        assert f"    {source.name} --> {target.name}: {event.value}" in lines
    for state in TERMINAL_STATES:
        assert f"    {state.name} --> [*]" in lines
    assert len(lines) == 2 + len(TRANSITIONS) + len(TERMINAL_STATES)


# -- the terminal state: one type, the same strings on disk ----------------------------------
H1, H2 = "ab" * 32, "cd" * 32
# Written before the terminal state was typed (RoundEntry.state was Literal["closed",
# "aborted"], Outcome.state Literal["closed", "aborted", "incomplete"]).
OLD_CLOSED_ENTRY = (
    '{"aggregate_digest":"' + H1 + '","attempt":1,"contributors":["p0","p1"],"count":2,'
    '"diagnostics":{},"late":[],"new_global_hash":"' + H2 + '","prior_global_hash":"' + H1 + '",'
    '"reason":null,"refused":{},"rejected":0,"round":1,"round_seed":7,"secure_sum":false,'
    '"state":"closed","total_weight":5,"update_digests":{"p0":"' + H1 + '","p1":"' + H1 + '"}}'
).encode()
OLD_ABORTED_ENTRY = (
    '{"aggregate_digest":null,"attempt":1,"contributors":[],"count":0,"diagnostics":{},'
    '"late":[],"new_global_hash":null,"prior_global_hash":"' + H2 + '",'
    '"reason":"FaultToleranceExceeded: x","refused":{},"rejected":0,"round":2,"round_seed":5,'
    '"secure_sum":false,"state":"aborted","total_weight":0,"update_digests":{}}'
).encode()
MANIFEST_DIGEST = "b61e5bb5dcdf3792a787e5f699c89a78093ef8aa7e14c179ea240097fff5109d"  # with invited
OLD_ABORTED_OUTCOME = (
    '{"contributors":[],"decided_by":"p0","error":"X","error_field":null,"global_hash":"'
    + H1
    + '","missing":[],"next":null,"reason":null,"round":1,"run_id":"run","sitting":1,'
    '"state":"aborted"}'
).encode()


def _closed_entry(state: object = RoundState.CLOSED) -> RoundEntry:
    return RoundEntry(
        round=1,
        attempt=1,
        state=state,  # type: ignore[arg-type]
        round_seed=7,
        prior_global_hash=H1,
        contributors=("p0", "p1"),
        count=2,
        total_weight=5,
        update_digests={"p0": H1, "p1": H1},
        aggregate_digest=H1,
        new_global_hash=H2,
    )


def _aborted_entry() -> RoundEntry:
    return RoundEntry(
        round=2,
        attempt=1,
        state=RoundState.ABORTED,
        reason="FaultToleranceExceeded: x",
        round_seed=5,
        prior_global_hash=H2,
    )


def test_the_terminal_states_are_the_round_states_a_machine_ends_in() -> None:
    assert set(get_args(TerminalState)) == TERMINAL_STATES == {S.CLOSED, S.ABORTED}
    assert set(TRANSITIONS.values()) - set(NON_TERMINAL) == TERMINAL_STATES
    assert [str(s) for s in (S.CLOSED, S.ABORTED)] == ["closed", "aborted"]
    assert f"{S.ABORTED}" == "aborted"  # what the CLI, the audit and logs print


def _with_invited(old: bytes) -> bytes:
    """An entry of that form written now: it records whom the attempt invited."""
    return old.replace(b'"late":', b'"invited":[],"late":')


def test_a_manifest_entry_written_with_the_type_is_the_old_string_form() -> None:
    for entry, old in ((_closed_entry(), OLD_CLOSED_ENTRY), (_aborted_entry(), OLD_ABORTED_ENTRY)):
        assert canonical_json(entry.model_dump(mode="json")) == _with_invited(old)
        assert type(entry.model_dump(mode="json")["state"]) is str
    manifest = RunManifest(
        run_id="r",
        config={},
        root_seed=0,
        initial_params_hash=H1,
        initial_checkpoint=H1,
        rounds=(_closed_entry(), _aborted_entry()),
    )
    assert manifest.digest == MANIFEST_DIGEST


def test_a_manifest_entry_written_before_the_type_loads_as_the_type() -> None:
    closed = parse_document(RoundEntry, OLD_CLOSED_ENTRY, "entry")
    aborted = parse_document(RoundEntry, OLD_ABORTED_ENTRY, "entry")
    assert closed.state is RoundState.CLOSED and aborted.state is RoundState.ABORTED
    assert closed == _closed_entry() and aborted == _aborted_entry()
    assert closed.invited == ()  # written before entries recorded whom they invited
    assert canonical_json(closed.model_dump(mode="json")) == _with_invited(OLD_CLOSED_ENTRY)


def test_a_manifest_entry_takes_the_state_as_a_string_and_holds_the_type() -> None:
    entry = _closed_entry("closed")  # how a caller that spells it still writes it
    assert entry.state is RoundState.CLOSED and entry == _closed_entry()


@pytest.mark.parametrize("state", [*NON_TERMINAL, "open", "done", None])
def test_a_manifest_entry_holds_a_terminal_state_only(state: object) -> None:
    with pytest.raises(ValidationError):
        _closed_entry(state)


@pytest.mark.parametrize("state", [b'"open"', b'"CLOSED"', b"null"])
def test_a_stored_manifest_entry_with_another_state_does_not_parse(state: bytes) -> None:
    with pytest.raises(UnreadableDocument) as caught:
        parse_document(RoundEntry, OLD_CLOSED_ENTRY.replace(b'"closed"', state), "entry")
    assert caught.value.detail.startswith("state: ")


def test_a_shared_folder_outcome_uses_the_same_type_and_the_same_strings() -> None:
    outcome = Outcome(
        run_id="run",
        round=1,
        sitting=1,
        state=RoundState.ABORTED,
        decided_by="p0",
        error="X",
        global_hash=H1,
    )
    assert encode(outcome) == OLD_ABORTED_OUTCOME
    assert decode_outcome(OLD_ABORTED_OUTCOME).state is RoundState.ABORTED
    incomplete = outcome.model_copy(update={"state": "incomplete"})
    assert decode_outcome(encode(incomplete)).state == "incomplete"  # a sitting, not a round
    with pytest.raises(Exception, match="does not parse"):
        decode_outcome(OLD_ABORTED_OUTCOME.replace(b'"aborted"', b'"open"'))


def test_a_run_summary_prints_the_state_as_its_string() -> None:
    entry = _aborted_entry()
    row = AttemptSummary(
        round=entry.round,
        attempt=entry.attempt,
        state=entry.state,
        count=0,
        contributors=(),
        late=(),
        refused={},
        reason=entry.reason,
        secure_sum=False,
        diagnostics={},
        epsilon={},
        new_global_hash=None,
    )
    assert json.loads(json.dumps(row.to_json()))["state"] == "aborted"
    assert json.dumps(row.to_json()["state"]) == '"aborted"'


def _params() -> dict[str, np.ndarray]:
    return {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.array([0.5, -0.25], np.float32),
    }


def test_global_state_create_snapshots_and_hashes() -> None:
    params = _params()
    gs = GlobalState.create(4, params, sketch_seed=11, h_steps=10)
    assert list(gs.params) == ["b", "w"]
    assert gs.params_hash == digest_arrays(params, "params")
    params["w"][0, 0] = 100.0
    params["b"] = np.zeros(2, np.float32)
    assert gs.params["w"][0, 0] == 0.0
    np.testing.assert_array_equal(gs.params["b"], [0.5, -0.25])
    assert gs.verify() is gs
    for array in gs.params.values():
        assert not array.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            array[...] = 1.0


def test_global_state_verify_detects_swapped_params() -> None:
    gs = GlobalState.create(2, _params(), sketch_seed=1, h_steps=5)
    swapped = dataclasses.replace(gs, params={"b": gs.params["b"], "w": gs.params["w"] + 1})
    with pytest.raises(CheckpointIntegrityError, match="round 3 global params hash"):
        swapped.verify()
    # swapping the contents of the (mutable) dict in place is caught as well
    gs.params["w"] = np.zeros((2, 3), np.float32)
    with pytest.raises(CheckpointIntegrityError):
        gs.verify()


def test_global_state_verify_detects_renamed_params() -> None:
    gs = GlobalState.create(0, _params(), sketch_seed=1, h_steps=5)
    renamed = dataclasses.replace(gs, params={"a": gs.params["b"], "w": gs.params["w"]})
    with pytest.raises(CheckpointIntegrityError):
        renamed.verify()
