"""The codec between lensemble wire payloads and Flower RecordDicts (strategies.records)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from lensemble_flwr.protocol.messages import (
    Commitment,
    ControlMessage,
    MessageKind,
    RoundClose,
    RoundOpen,
    Update,
    from_wire,
    kind_of,
    message_digest,
    to_wire,
)
from lensemble_flwr.strategies import records

ROOT = "ab" * 32
HASH = "cd" * 32
PARAMS = {
    "encoder.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
    "predictor.bias": np.array([0.5, -1.25], dtype=np.float64),
}


@pytest.fixture(autouse=True)
def _serverapp_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Message(content, dst_node_id, message_type)`` reads the sending process's identity,
    which Flower sets when it starts a ServerApp; tests set it the same way."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", SUPERLINK_NODE_ID)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


def round_open(**changes: Any) -> RoundOpen:
    fields: dict[str, Any] = {
        "run_id": "run",
        "round": 4,
        "sender": "coordinator",
        "attempt": 2,
        "global_hash": HASH,
        "params": PARAMS,
        "sketch_seed": 2**62 + 5,
        "h_steps": 4,
        "probe_hash": "",
        "landmark_hashes": (),
        "needs_commitment": False,
    }
    fields.update(changes)
    return RoundOpen(**fields)


def round_close(**changes: Any) -> RoundClose:
    fields: dict[str, Any] = {
        "run_id": "run",
        "round": 3,
        "sender": "coordinator",
        "previous_hash": ROOT,
        "global_hash": HASH,
        "count": 2,
        "record_hash": "ef" * 32,
    }
    fields.update(changes)
    return RoundClose(**fields)


def commitment(pid: str = "node-11") -> Commitment:
    return Commitment(
        run_id="run",
        round=4,
        attempt=2,
        sender=pid,
        participant_id=pid,
        dataset_root=ROOT,
        num_examples=64,
    )


def update(pid: str = "node-11", **changes: Any) -> Update:
    fields: dict[str, Any] = {
        "run_id": "run",
        "round": 4,
        "attempt": 2,
        "sender": pid,
        "participant_id": pid,
        "dataset_root": ROOT,
        "delta": {n: np.full_like(a, -0.125) for n, a in PARAMS.items()},
        "l2_norm": 0.3,
        "num_examples": 64,
        "transforms": ("difference", "bind"),
    }
    fields.update(changes)
    return Update(**fields)


def assert_same(decoded: ControlMessage, original: ControlMessage) -> None:
    """Same type, every field equal with the same Python type, arrays bit-equal with the
    same dtype and shape, and the same canonical digest."""
    assert type(decoded) is type(original)
    for name in type(original).model_fields:
        got, want = getattr(decoded, name), getattr(original, name)
        if name in ("params", "delta"):
            assert list(got) == list(want)
            for key in want:
                assert got[key].dtype == want[key].dtype, key
                assert got[key].shape == want[key].shape, key
                assert np.array_equal(got[key], want[key]), key
        else:
            assert got == want, name
            assert type(got) is type(want), name
    assert message_digest(decoded) == message_digest(original)


def config_values(content: RecordDict) -> list[Any]:
    return [v for record in content.config_records.values() for v in record.values()]


# -- why the codec exists -------------------------------------------------------------------
def test_flower_config_records_cannot_carry_none_empty_strings_or_empty_lists() -> None:
    with pytest.raises(ValueError):
        ConfigRecord({"k": ""}).count_bytes()
    with pytest.raises(IndexError):
        ConfigRecord({"k": []}).count_bytes()
    with pytest.raises(TypeError):
        ConfigRecord({"k": None})


def test_encoded_records_avoid_the_values_flower_chokes_on() -> None:
    content = records.encode_instruction(
        to_wire(round_open()),
        server_round=4,
        round_close=to_wire(round_close()),
    )
    reply = records.encode_reply(
        [to_wire(update(dataset_root=None, transforms=()))], {"num-examples": 64}
    )
    for encoded in (content, reply):
        values = config_values(encoded)
        assert all(v is not None and v != "" and v != [] for v in values)
        # what a Grid does before sending: count every record's bytes
        assert all(r.count_bytes() > 0 for r in encoded.config_records.values())


# -- round trips ----------------------------------------------------------------------------
def test_round_open_and_piggybacked_close_round_trip_close_first() -> None:
    opened, closed = round_open(), round_close()
    content = records.encode_instruction(
        to_wire(opened), server_round=4, user_config={"lr": 0.1}, round_close=to_wire(closed)
    )
    payloads = records.decode_instruction(content)
    assert [kind_of(p) for p in payloads] == [MessageKind.ROUND_CLOSE, MessageKind.ROUND_OPEN]
    assert all(type(p["kind"]) is str for p in payloads)  # what Flower carried: plain strings
    assert_same(from_wire(payloads[0]), closed)
    assert_same(from_wire(payloads[1]), opened)


def test_round_open_with_non_empty_optional_fields_round_trips() -> None:
    opened = round_open(
        probe_hash=ROOT, landmark_hashes=(ROOT, HASH), needs_commitment=True, attempt=1
    )
    content = records.encode_instruction(to_wire(opened), server_round=1)
    assert records.CLOSE_PREFIX + "kind" not in content["config"]
    (payload,) = records.decode_instruction(content)
    assert_same(from_wire(payload), opened)


def test_records_of_holds_what_flowers_views_hold_in_their_order() -> None:
    content = RecordDict(
        {
            "b": ConfigRecord({"x": 1}),
            "a": ArrayRecord({"w": Array(np.zeros(2, np.float32))}),
            "m": MetricRecord({"loss": 0.5}),
            "c": ConfigRecord({"y": "z"}),
        }
    )
    for kind, view in (
        (ConfigRecord, content.config_records),
        (ArrayRecord, content.array_records),
        (MetricRecord, content.metric_records),
    ):
        ours = records.records_of(content, kind)
        assert list(ours) == list(view) and all(ours[k] is view[k] for k in view)


def test_an_instruction_shares_an_earlier_config_record_only_when_it_is_the_same() -> None:
    first = records.encode_instruction(to_wire(round_open()), server_round=4)["config"]
    again = records.encode_instruction(to_wire(round_open()), server_round=4, reuse=first)
    assert again["config"] is first
    for other in (
        {"opened": round_open(needs_commitment=True), "server_round": 4},
        {"opened": round_open(), "server_round": 5},
        {"opened": round_open(), "server_round": 4, "round_close": to_wire(round_close())},
    ):
        opened = other.pop("opened")
        content = records.encode_instruction(to_wire(opened), reuse=first, **other)
        assert content["config"] is not first
        assert_same(from_wire(records.decode_instruction(content)[-1]), opened)
    first["lensemble.h_steps"] = 5  # a record changed after it was sent is not reused
    content = records.encode_instruction(to_wire(round_open()), server_round=4, reuse=first)
    assert content["config"] is not first and content["config"]["lensemble.h_steps"] == 4


def test_empty_and_null_fields_survive() -> None:
    opened = round_open(probe_hash="", landmark_hashes=())
    (payload,) = records.decode_instruction(
        records.encode_instruction(to_wire(opened), server_round=1)
    )
    assert payload["probe_hash"] == "" and list(payload["landmark_hashes"]) == []
    assert from_wire(payload).landmark_hashes == ()

    unbound = update(dataset_root=None, transforms=())
    (payload,) = records.decode_reply(records.encode_reply([to_wire(unbound)], {}))
    assert payload["dataset_root"] is None and list(payload["transforms"]) == []
    assert_same(from_wire(payload), unbound)


def test_commitment_and_update_round_trip_in_protocol_order() -> None:
    sent = [commitment(), update()]
    for order in (sent, sent[::-1]):
        content = records.encode_reply(
            [to_wire(m) for m in order], {"num-examples": 64, "train-loss": 0.5}
        )
        assert records.is_lensemble_reply(content)
        payloads = records.decode_reply(content)
        assert [kind_of(p) for p in payloads] == [MessageKind.COMMITMENT, MessageKind.UPDATE]
        assert all(type(p["kind"]) is str for p in payloads)
        for payload, original in zip(payloads, sent, strict=True):
            assert_same(from_wire(payload), original)
        assert dict(content[records.METRICS]) == {"num-examples": 64, "train-loss": 0.5}


def test_a_steady_state_reply_is_the_update_alone() -> None:
    content = records.encode_reply([to_wire(update())], {"num-examples": 64})
    assert records.PREFIX + MessageKind.COMMITMENT.value not in content.config_records
    (payload,) = records.decode_reply(content)
    assert_same(from_wire(payload), update())


def test_a_participant_sends_only_commitments_and_updates() -> None:
    for message in (round_open(), round_close()):
        with pytest.raises(ValueError, match=message.kind.value):
            records.encode_reply([to_wire(message)], {})


def test_a_close_in_an_evaluate_config_decodes_like_the_piggybacked_one() -> None:
    content = RecordDict(
        {"config": ConfigRecord({"lr": 0.1, **records.encode_close(to_wire(round_close()))})}
    )
    (payload,) = records.decode_instruction(content)
    assert_same(from_wire(payload), round_close())


def test_content_without_lensemble_records_decodes_to_nothing() -> None:
    stock = RecordDict({"arrays": records.arrays_to_record(PARAMS), "config": ConfigRecord({})})
    assert records.decode_instruction(stock) == []
    assert records.decode_reply(stock) == []
    assert not records.is_lensemble_reply(stock)


# -- what a stock ClientApp sees and sends ----------------------------------------------------
def quickstart_app() -> tuple[ClientApp, dict[str, Any]]:
    """A Message-API ClientApp written the way Flower's quickstarts write one."""
    app, seen = ClientApp(), {}

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        arrays = msg.content["arrays"]
        config = msg.content["config"]
        seen.update(server_round=config["server-round"], lr=config["lr"], names=list(arrays))
        trained = {name: Array(a.numpy() + config["lr"]) for name, a in arrays.items()}
        metrics = {"train_loss": 0.25, "num-examples": 32}
        return Message(
            RecordDict({"arrays": ArrayRecord(trained), "metrics": MetricRecord(metrics)}),
            reply_to=msg,
        )

    return app, seen


def test_an_instruction_is_a_train_message_a_stock_clientapp_reads() -> None:
    content = records.encode_instruction(
        to_wire(round_open()),
        server_round=4,
        user_config={"lr": 0.5, "local-epochs": 2},
        round_close=to_wire(round_close()),
    )
    assert content["config"]["server-round"] == 4
    assert content["config"]["local-epochs"] == 2
    assert set(records.record_to_arrays(content["arrays"])) == set(PARAMS)

    app, seen = quickstart_app()
    instruction = Message(content, 7, "train", ttl=60)
    instruction.metadata.__dict__["_message_id"] = "m-1"  # what a Grid does on push
    context = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    reply = app(instruction, context)

    assert seen == {"server_round": 4, "lr": 0.5, "names": sorted(PARAMS)}
    assert reply.metadata.reply_to_message_id == "m-1"
    stock = records.stock_reply(reply.content)
    assert stock is not None
    arrays, count, metrics = stock
    assert count == 32 and metrics == {"train_loss": 0.25, "num-examples": 32.0}
    for name, array in PARAMS.items():
        np.testing.assert_array_equal(arrays[name], array + 0.5)
    assert not records.is_lensemble_reply(reply.content)


def test_server_round_wins_over_a_user_key_of_the_same_name() -> None:
    content = records.encode_instruction(
        to_wire(round_open()), server_round=4, user_config={"server-round": 99}
    )
    assert content["config"]["server-round"] == 4


def test_stock_reply_accepts_one_array_record_under_any_name() -> None:
    content = RecordDict(
        {"model": records.arrays_to_record(PARAMS), "m": MetricRecord({"num-examples": 5})}
    )
    stock = records.stock_reply(content)
    assert stock is not None and stock[1] == 5 and set(stock[0]) == set(PARAMS)


@pytest.mark.parametrize(
    "content",
    [
        RecordDict({"arrays": ArrayRecord(), "metrics": MetricRecord({"train_loss": 0.1})}),
        RecordDict({"arrays": ArrayRecord(), "metrics": MetricRecord({"num-examples": 0})}),
        RecordDict({"metrics": MetricRecord({"num-examples": 5})}),
        RecordDict(
            {
                "arrays": ArrayRecord(),
                "a": MetricRecord({"num-examples": 5}),
                "b": MetricRecord({"num-examples": 5}),
            }
        ),
    ],
    ids=["no-num-examples", "zero-examples", "no-arrays", "two-metric-records"],
)
def test_stock_reply_rejects_what_is_not_a_train_reply(content: RecordDict) -> None:
    assert records.stock_reply(content) is None


# -- participant ids ------------------------------------------------------------------------
@pytest.mark.parametrize("node_id", [0, 7, 2**64 - 1])
def test_participant_ids_round_trip(node_id: int) -> None:
    assert records.participant_id(node_id) == f"node-{node_id}"
    assert records.node_id_of(records.participant_id(node_id)) == node_id


@pytest.mark.parametrize("bad", ["p01", "coordinator", "node-", "node-x", "Node-3"])
def test_node_id_of_refuses_a_participant_that_is_not_a_node(bad: str) -> None:
    with pytest.raises(ValueError):
        records.node_id_of(bad)
