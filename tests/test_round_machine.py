"""Tests of the round state machine and the pinned global state."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from lensemble_flwr.canonical import digest_arrays
from lensemble_flwr.errors import CheckpointIntegrityError, IllegalTransition
from lensemble_flwr.protocol.round import (
    TERMINAL_STATES,
    TRANSITIONS,
    RoundEvent,
    RoundMachine,
    RoundState,
    next_state,
    transition_diagram,
)
from lensemble_flwr.protocol.state import GlobalState

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
    m = RoundMachine(round=3)
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
    m = RoundMachine(round=0)
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
    with pytest.raises(CheckpointIntegrityError, match="round 2 global params hash"):
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
