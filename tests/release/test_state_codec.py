"""A participant's state is whole: every release stage's state is exported and restored
with it (release/state_codec.py), also across Flower message boundaries."""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
from federation_helpers import federation, small_config
from flwr.app import Context, Message, RecordDict
from flwr.common.serde import context_from_proto, context_to_proto
from flwr.proto.message_pb2 import Context as ProtoContext  # type: ignore[attr-defined]
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lensemble_flwr.canonical import canonical_json
from lensemble_flwr.clients.app import make_client_app
from lensemble_flwr.clients.state import load_state, save_state
from lensemble_flwr.errors import ConfigError, RoundError
from lensemble_flwr.participant.local_training import PortableState
from lensemble_flwr.participant.participant import Participant, training_state
from lensemble_flwr.protocol.messages import (
    MessageKind,
    RoundClose,
    RoundOpen,
    Update,
    from_wire,
    kind_of,
    to_wire,
)
from lensemble_flwr.protocol.state import GlobalState
from lensemble_flwr.release import (
    Release,
    ReleaseContext,
    ReleaseTransform,
    Stage,
    bind,
    chain,
    difference,
)
from lensemble_flwr.release.pipeline import ChainState, no_state
from lensemble_flwr.release.state_codec import export_release_state, import_release_state
from lensemble_flwr.simulations.crash_drill import decode_state, encode_state
from lensemble_flwr.simulations.toy import ToyTrainer, initial_params
from lensemble_flwr.strategies import records
from lensemble_flwr.transports.inprocess import InProcessNetwork
from tests.strategies.test_records import _serverapp_identity  # noqa: F401  (autouse: the ServerApp identity)


# -- a stateful stage ----------------------------------------------------------------------
class Residual(NamedTuple):
    """Error feedback's state: rounds released so far, and what is still owed."""

    rounds: int
    carry: dict[str, np.ndarray]


def error_feedback() -> ReleaseTransform:
    """Release half of (delta + carry) and carry the other half into the next round
    (a QUANTIZE-stage compressor with error feedback, as in EF-SGD)."""

    def init(params: Mapping[str, np.ndarray]) -> Residual:
        return Residual(0, {n: np.zeros(a.shape, np.float32) for n, a in sorted(params.items())})

    def update(release: Release, state: Residual, ctx: ReleaseContext) -> tuple[Release, Any]:
        assert release.delta is not None
        total = {n: (a + state.carry[n]).astype(np.float32) for n, a in release.delta.items()}
        sent = {n: (t * np.float32(0.5)).astype(np.float32) for n, t in total.items()}
        carry = {n: (total[n] - sent[n]).astype(np.float32) for n in total}
        return release.replace(delta=sent), Residual(state.rounds + 1, carry)

    return ReleaseTransform("error_feedback", Stage.QUANTIZE, init, update)


def ef_pipeline() -> ReleaseTransform:
    return chain(difference(), error_feedback(), bind())


def stage_with_state(state: Any, name: str = "keeper") -> ReleaseTransform:
    """A stage whose state becomes ``state`` after its first round."""

    def update(release: Release, _state: Any, ctx: ReleaseContext) -> tuple[Release, Any]:
        return release, state

    return ReleaseTransform(name, Stage.CLIP, no_state, update)


def participant(
    pipeline: ReleaseTransform | None = None, index: int = 1, pid: str = "p"
) -> Participant:
    return Participant(
        small_config(),
        participant_id=pid,
        transport=InProcessNetwork().transport_for(pid),
        trainer=ToyTrainer(index),
        pipeline=pipeline,
    )


def global_state(rnd: int) -> GlobalState:
    return GlobalState.create(rnd, initial_params(seed=rnd), sketch_seed=100 + rnd, h_steps=2)


# -- (a) the codec round-trips exactly -----------------------------------------------------
class Point(NamedTuple):
    x: Any
    y: Any


def assert_identical(a: Any, b: Any, where: str = "state") -> None:
    """Same value, same types all the way down (dtype and shape of arrays, NamedTuple
    classes, bit patterns of floats)."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), where
    elif isinstance(a, float):
        assert a.hex() == b.hex() or (math.isnan(a) and math.isnan(b)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


DTYPES = [np.int8, np.float32, np.float64, np.bool_, np.uint64, np.int64, np.float16]
arrays = st.sampled_from(DTYPES).flatmap(
    lambda dtype: hnp.arrays(dtype, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0))
)
scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
keys = st.text(max_size=4) | st.integers(-5, 5) | st.tuples(st.integers(0, 3), st.text(max_size=2))
leaves = scalars | arrays | arrays.map(lambda a: a.reshape(-1)[0] if a.size else a)
values = st.recursive(
    leaves,
    lambda inner: (
        st.tuples(inner, inner)
        | st.lists(inner, max_size=3)
        | st.dictionaries(keys, inner, max_size=3)
        | st.builds(Point, inner, inner)
        | st.builds(ChainState, st.tuples(inner))
    ),
    max_leaves=12,
)


def through_flower_and_safetensors(
    arrays: dict[str, np.ndarray], meta: dict[str, Any]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """What a saved state goes through: Flower's context.state, and the crash drill's
    safetensors file; the meta as canonical JSON."""
    record = RecordDict()
    save_state(record, PortableState(arrays=arrays, meta=meta))
    kept = decode_state(encode_state(load_state(record)))
    return kept.arrays, json.loads(canonical_json(kept.meta))


@settings(max_examples=150, deadline=None)
@given(values)
def test_any_allowed_state_round_trips_exactly(value: Any) -> None:
    pipeline = stage_with_state(value)
    arrays, meta = export_release_state(pipeline, value)
    restored = import_release_state(pipeline, *through_flower_and_safetensors(arrays, meta))
    assert_identical(value, restored)


@settings(max_examples=50, deadline=None)
@given(values, values)
def test_a_chain_state_round_trips_stage_by_stage(first: Any, second: Any) -> None:
    pipeline = chain(difference(), stage_with_state(first), bind())
    state = ChainState((None, first, second))
    arrays, meta = export_release_state(pipeline, state)
    assert [p["stage"] for p in meta["state"]["parts"]] == ["difference", "keeper", "bind"]
    restored = import_release_state(pipeline, *through_flower_and_safetensors(arrays, meta))
    assert_identical(state, restored)


def test_edge_values_round_trip() -> None:
    value = {
        "empty": (np.zeros((0,), np.int8), np.zeros((3, 0), np.float32), np.zeros((0, 0))),
        "floats": [float("nan"), float("inf"), -0.0, 5e-324, np.float32(-0.0)],
        "ints": (2**200, -(2**70), np.int8(-128), np.uint64(2**64 - 1)),
        "nested": Point(Residual(3, {"w": np.arange(6, dtype=np.float64).reshape(2, 3)}), None),
        (1, "k"): [True, False, np.bool_(True)],
        "strided": np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],
    }
    pipeline = stage_with_state(value)
    arrays, meta = export_release_state(pipeline, value)
    assert all(a.flags.c_contiguous for a in arrays.values())
    restored = import_release_state(pipeline, *through_flower_and_safetensors(arrays, meta))
    assert_identical(value, restored)
    assert type(restored["nested"].x) is Residual
    restored["strided"][0, 0] = 99  # a restored array is the participant's own copy
    assert value["strided"][0, 0] == 0


def test_an_uninitialised_pipeline_state_exports_none() -> None:
    p = participant(ef_pipeline())
    exported = p.export_state()
    assert exported.meta["release"]["state"] == {"t": "none"}
    assert not any(k.startswith("release/") for k in exported.arrays)
    fresh = participant(ef_pipeline())
    fresh.import_state(exported)
    assert fresh.pipeline_state is None


def test_training_state_is_still_only_the_training_part() -> None:
    p = participant(ef_pipeline())
    p.local_round(global_state(0), 11)
    exported = p.export_state()
    assert any(k.startswith("release/") for k in exported.arrays)
    inner = training_state(exported)
    assert inner.meta == p.training.export_state().meta
    assert set(inner.arrays) == set(p.training.export_state().arrays)


def test_a_state_saved_before_release_states_were_exported_still_imports() -> None:
    p = participant(ef_pipeline())
    p.local_round(global_state(0), 11)
    old = p.export_state()
    meta = {k: v for k, v in old.meta.items() if k != "release"}
    arrays = {k: v for k, v in old.arrays.items() if not k.startswith("release/")}
    fresh = participant(ef_pipeline())
    fresh.import_state(PortableState(arrays=arrays, meta=meta))
    assert fresh.pipeline_state is None and fresh.last_answered == p.last_answered


def test_a_state_whose_close_lists_the_contributors_still_imports() -> None:
    """An earlier version's RoundClose listed the contributors' ids; a state saved with
    one loads as the close of as many contributors."""
    p = participant(ef_pipeline())
    p.local_round(global_state(0), 11)
    close = RoundClose(
        run_id="run", round=1, sender="coordinator", previous_hash="ab" * 32,
        global_hash="cd" * 32, count=2, record_hash="ef" * 32,
    )  # fmt: skip
    p.handle(to_wire(close))
    old = p.export_state()
    saved = {k: v for k, v in old.meta["last_close"].items() if k != "count"}
    meta = {**old.meta, "last_close": {**saved, "contributors": ["p1", "p2"]}}
    fresh = participant(ef_pipeline())
    fresh.import_state(PortableState(arrays=old.arrays, meta=meta))
    assert fresh.last_close == close


def test_the_saved_state_does_not_grow_with_the_federation(tmp_path: Path) -> None:
    """Every node saves its state after every message (Flower's simulation engine ships it
    to and from an actor each time): what it holds about the round must not list the
    other participants, or a message would cost O(N) and a round O(N^2)."""

    def saved_bytes(participants: int) -> int:
        coordinator, network, nodes = federation(tmp_path, participants=participants,
                                                 name=f"run-{participants}")  # fmt: skip
        coordinator.run(2)
        network.flush()
        assert coordinator.outcomes[-1].count == participants
        return len(canonical_json(nodes[0].export_state().meta))

    assert saved_bytes(12) - saved_bytes(3) <= 4  # "count": 12 against 3, nothing more


# -- (b) a state that cannot be exported is refused at export, naming the stage ------------
def _local_namedtuple() -> Any:
    class Local(NamedTuple):
        a: int

    return Local(1)


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        ({"seen": {1, 2}}, r"state\['seen'\]: cannot export a value of type builtins.set"),
        ([object()], r"state\[0\]: cannot export a value of type builtins.object"),
        (np.array([None], dtype=object), "cannot export an array of dtype object"),
        (np.array([1 + 2j]), "cannot export an array of dtype complex128"),
        (np.array([1.0], dtype=">f8"), "byte order"),
        (OrderedDict(a=1), "collections.OrderedDict"),
        (Stage.CLIP, "lensemble_flwr.release.pipeline.Stage"),
        (_local_namedtuple(), "cannot be found again by its name"),
        ({np.int8(1): 2}, "an array cannot be a dict key"),
    ],
)
def test_an_unexportable_stage_state_is_refused_at_export_naming_the_stage(
    state: Any, reason: str
) -> None:
    p = participant(chain(difference(), stage_with_state(state, "my_sketch"), bind()))
    p.local_round(global_state(0), 11)  # the stage runs: its state is kept in memory
    with pytest.raises(ConfigError, match=reason) as caught:
        p.export_state()
    assert caught.value.field == "release stage 'my_sketch'"


def test_a_cyclic_state_is_refused() -> None:
    cycle: list[Any] = [1]
    cycle.append(cycle)
    with pytest.raises(ConfigError, match="cycle"):
        export_release_state(stage_with_state(cycle), cycle)


def test_a_chain_whose_state_is_not_a_chain_state_is_refused() -> None:
    with pytest.raises(ConfigError, match="not a ChainState of 3 entries"):
        export_release_state(ef_pipeline(), ChainState((None, None)))


# -- (c) a malformed restore is refused and changes nothing --------------------------------
def tampered(state: PortableState, change: str) -> PortableState:
    arrays = dict(state.arrays)
    meta = json.loads(json.dumps(state.meta))
    release = meta["release"]
    ef = release["state"]["parts"][1]
    carry = ef["state"]["items"][1]["items"]  # the dict of Residual.carry
    first_key = carry[0][1]["key"]
    if change == "other pipeline":
        release["stage"] = "chain(difference,bind)"
    elif change == "stage order":
        release["state"]["parts"][1]["stage"] = "bind"
    elif change == "arity":
        release["state"]["parts"].pop()
    elif change == "missing array":
        del arrays[f"release/{first_key}"]
    elif change == "extra array":
        arrays["release/999"] = np.zeros(2, np.float32)
    elif change == "dtype":
        arrays[f"release/{first_key}"] = arrays[f"release/{first_key}"].astype(np.float64)
    elif change == "shape":
        arrays[f"release/{first_key}"] = arrays[f"release/{first_key}"].reshape(-1)[:1]
    elif change == "class":
        ef["state"]["class"] = "tests_nowhere:Residual"
    elif change == "fields":
        ef["state"]["fields"] = ["rounds", "owed"]
    elif change == "unknown node":
        ef["state"]["items"][0] = {"t": "pickle", "v": "gASV"}
    elif change == "bad int":
        ef["state"]["items"][0] = {"t": "int", "v": "1e9"}
    elif change == "format":
        release["format"] = 99
    elif change == "arrays without description":
        del meta["release"]
    return PortableState(arrays=arrays, meta=meta)


CHANGES = [
    "other pipeline",
    "stage order",
    "arity",
    "missing array",
    "extra array",
    "dtype",
    "shape",
    "class",
    "fields",
    "unknown node",
    "bad int",
    "format",
    "arrays without description",
]


@pytest.mark.parametrize("change", CHANGES)
def test_a_malformed_release_state_is_refused_and_changes_nothing(change: str) -> None:
    donor = participant(ef_pipeline())
    donor.local_round(global_state(0), 11)
    good = donor.export_state()
    assert good.meta["release"]["state"]["parts"][1]["state"]["class"].endswith(":Residual")

    target = participant(ef_pipeline(), index=2)
    target.local_round(global_state(0), 11)
    target.local_round(global_state(1), 12)
    before = target.export_state()
    with pytest.raises(RoundError, match="release state"):
        target.import_state(tampered(good, change))
    after = target.export_state()
    assert after.meta == before.meta
    assert after.arrays.keys() == before.arrays.keys()
    for name in before.arrays:
        np.testing.assert_array_equal(after.arrays[name], before.arrays[name])
    assert target.pipeline_state.states[1].rounds == 2
    target.import_state(good)  # the untampered state is accepted
    assert target.pipeline_state.states[1].rounds == 1


def test_a_none_state_fits_any_pipeline() -> None:
    exported = participant(ef_pipeline()).export_state()
    other = participant(chain(difference(), bind()))
    other.import_state(exported)
    assert other.pipeline_state is None


def test_a_chain_of_stateless_stages_fits_another_chain_but_a_stateful_one_does_not() -> None:
    """A masked federation's chain gained a mask stage: a state its stateless stages saved
    before restores as None; one that holds something is still refused."""
    stateless = participant(chain(difference(), bind()))
    stateless.local_round(global_state(0), 11)
    assert stateless.pipeline_state == ChainState((None, None))
    other = participant(chain(difference(), stage_with_state(None), bind()))
    other.import_state(stateless.export_state())
    assert other.pipeline_state is None
    kept = participant(ef_pipeline())
    kept.local_round(global_state(0), 11)
    with pytest.raises(RoundError, match="saved by pipeline"):
        other.import_state(kept.export_state())


# -- (d) a stateful stage carried across Flower message boundaries -------------------------
NODE = 7


def train_message(rnd: int) -> Message:
    state = global_state(rnd)
    round_open = RoundOpen(
        run_id="run",
        round=state.next_round,  # round rnd + 1 starts from θ_rnd
        sender="coordinator",
        attempt=1,
        global_hash=state.params_hash,
        params=state.params,
        sketch_seed=state.sketch_seed,
        h_steps=state.h_steps,
        probe_hash="",
        landmark_hashes=(),
        needs_commitment=rnd == 0,
    )
    content = records.encode_instruction(to_wire(round_open), server_round=rnd + 1)
    message = Message(content, NODE, "train", ttl=60)
    message.metadata.__dict__["_message_id"] = f"m-{rnd}"  # what a Grid does on push
    return message


def next_process(context: Context) -> Context:
    """The Context a SuperNode hands the next message's process: the same node and run,
    and the state the last message left, through its protobuf form."""
    proto = ProtoContext()
    proto.ParseFromString(context_to_proto(context).SerializeToString())
    return context_from_proto(proto)


def released_update(reply: Message) -> Update:
    payloads = records.decode_reply(reply.content)
    (update,) = [p for p in payloads if kind_of(p) is MessageKind.UPDATE]
    message = from_wire(update)
    assert isinstance(message, Update)
    return message


def test_a_stateful_stage_is_carried_across_flower_message_boundaries() -> None:
    config = small_config()
    app = make_client_app(
        lambda context: ToyTrainer(1),  # a fresh trainer for every message
        config_fn=lambda context: config,
        identity_fn=lambda context: None,
        pipeline_fn=lambda context: ef_pipeline(),
        evaluate_fn=None,
    )
    context = Context(run_id=1, node_id=NODE, node_config={}, state=RecordDict(), run_config={})
    updates = []
    for rnd in (0, 1):
        reply = app(train_message(rnd), context)
        assert not reply.has_error(), reply.error
        updates.append(released_update(reply))
        context = next_process(context)  # the participant does not outlive the message

    # the same participant kept alive in one process releases exactly the same updates
    alive = participant(ef_pipeline(), pid=records.participant_id(NODE))
    expected = [alive.local_round(global_state(r), global_state(r).sketch_seed) for r in (0, 1)]
    for got, want in zip(updates, expected, strict=True):
        assert got.transforms == ("difference", "error_feedback", "bind")
        assert got.delta.keys() == want.delta.keys()
        for name in want.delta:
            np.testing.assert_array_equal(got.delta[name], want.delta[name])

    # and the second update carries what the first round left owed (carry = the half
    # not sent = the first update): a stage restarted from init releases only half of
    # its own delta, a different release
    first = participant(ef_pipeline(), pid=records.participant_id(NODE))
    first.local_round(global_state(0), global_state(0).sketch_seed)
    saved = first.export_state()
    restarted = participant(ef_pipeline(), pid=records.participant_id(NODE))
    restarted.import_state(
        PortableState(
            arrays={k: v for k, v in saved.arrays.items() if not k.startswith("release/")},
            meta={k: v for k, v in saved.meta.items() if k != "release"},
        )
    )
    from_init = restarted.local_round(global_state(1), global_state(1).sketch_seed).delta
    assert any(not np.array_equal(updates[1].delta[n], from_init[n]) for n in from_init)
    for name, sent in updates[1].delta.items():
        np.testing.assert_allclose(
            sent, from_init[name] + 0.5 * updates[0].delta[name], rtol=1e-5, atol=1e-7
        )
    kept = participant(ef_pipeline())
    kept.import_state(load_state(context.state))
    assert kept.pipeline_state.states[1].rounds == 2
