"""Ingress validation of the four control messages (property-based)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from federation_helpers import federation
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lensemble_flwr.errors import RoundError
from lensemble_flwr.protocol.messages import (
    Commitment,
    RoundClose,
    RoundOpen,
    Update,
    from_wire,
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
            round=2,
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
            run_id="r", round=0, sender="p", participant_id="p", dataset_root=ROOT, num_examples=3
        ),
        RoundOpen(
            run_id="r",
            round=0,
            sender="coordinator",
            global_hash=ROOT,
            params={"w": np.zeros(2, np.float32)},
            sketch_seed=1,
            h_steps=2,
        ),
        RoundClose(
            run_id="r",
            round=0,
            sender="coordinator",
            previous_hash=ROOT,
            global_hash=ROOT,
            contributors=("p",),
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
    assert message_digest(from_wire(good_update(round=3))) != base
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
    base=st.sampled_from(["update", "commitment", "round-open", "garbage"]),
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
    payload: Any = good_update() if base == "update" else {"kind": base}
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
        faults.corrupt(pid, round=0, kind="update", mutate=apply)
    coordinator, _, _ = federation(tmp, participants=6, faults=faults)
    before = coordinator.global_state().params_hash
    coordinator.run(1)
    outcome = coordinator.outcomes[0]
    assert outcome.state is RoundState.CLOSED
    assert outcome.rejected == len(which)
    assert set(outcome.contributors) == {f"p0{i}" for i in range(6)} - set(corrupted)
    assert coordinator.global_state().params_hash != before
