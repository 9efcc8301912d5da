"""GridTransport over a fake Flower Grid on a fake clock: no Ray, no network, no real sleep."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from federation_helpers import small_config
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_ins_message
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.clients import app as app_module
from lensemble_flwr.clients.app import handle_train
from lensemble_flwr.clients.state import load_state
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.admission import Verdict
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.errors import FaultToleranceExceeded
from lensemble_flwr.identity.signing import IdentityKey
from lensemble_flwr.norms import l2_norm
from lensemble_flwr.protocol.messages import (
    Commitment,
    MessageKind,
    Refusal,
    RoundClose,
    RoundOpen,
    Update,
    from_wire,
    kind_of,
    to_wire,
)
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.simulations.toy import ToyTrainer, initial_params
from lensemble_flwr.strategies import records
from lensemble_flwr.strategies.grid_transport import (
    GridTransport,
    SentInstruction,
    malformed_refusal,
)
from lensemble_flwr.strategies.node_names import NodeNames
from lensemble_flwr.strategies.open_encoding import ENCODED_KEPT
from lensemble_flwr.strategies.records import participant_id
from lensemble_flwr.transports.base import (
    COORDINATOR,
    DeliveredFrom,
    FiledByTransport,
    ReplyCollector,
)

ROOT = "ab" * 32
HASH = "cd" * 32
PARAMS = {
    "b": np.array([0.5, -1.0], dtype=np.float32),
    "w": np.arange(6, dtype=np.float32).reshape(2, 3),
}
COMMITMENT = records.PREFIX + MessageKind.COMMITMENT.value
UPDATE = records.PREFIX + MessageKind.UPDATE.value

NodeFn = Callable[[Message], "Message | None"]


@pytest.fixture(autouse=True)
def _serverapp_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Message(content, dst_node_id, message_type)`` reads the sending process's identity,
    which Flower sets when it starts a ServerApp; tests set it the same way. Real sleeping
    is forbidden: every wait goes through the fake clock."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", SUPERLINK_NODE_ID)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)

    def no_real_sleep(seconds: float) -> None:
        raise AssertionError(f"a test slept for real ({seconds} s)")

    monkeypatch.setattr(time, "sleep", no_real_sleep)


# -- the fakes ----------------------------------------------------------------------------
class FakeClock:
    """Time moves only when the transport sleeps."""

    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0, seconds
        self.sleeps.append(seconds)
        self.t += seconds


@dataclasses.dataclass
class Stored:
    """One instruction held by the fake SuperLink, and the reply its node will give."""

    instruction: Message
    pushed_at: float
    reply: Message | None
    ready_at: float

    @property
    def expires_at(self) -> float:
        return self.pushed_at + self.instruction.metadata.ttl


class FakeGrid(Grid):
    """A SuperLink in a dict, on the fake clock.

    * ``push_messages`` names each message in place, as ``InMemoryGrid`` does
      (``metadata.__dict__["_message_id"] = uuid4()``), and leaves the messages it refuses
      (a destination that is not a connected node) out of the returned ids, as
      ``InMemoryGrid`` does. The destination's node function answers at once; its reply
      becomes pullable ``delay(node_id, instruction)`` seconds later (compute + network).
    * Node functions build their reply with ``Message(content, reply_to=instruction)``: with
      flwr 1.42 that derives the reply's metadata from the instruction (``src_node_id`` =
      the instruction's ``dst_node_id``, ``reply_to_message_id`` = its ``message_id``), which
      is why the message id must be set on the instruction before the node sees it. Nothing
      is faked in the reply's metadata.
    * ``pull_messages`` returns the ready replies and deletes them with their instructions.
      An instruction whose TTL passed before it was pulled (answered or not: a SuperLink
      drops an expired instruction with its reply) yields, once, the error reply a
      SuperLink generates (``create_message_error_unavailable_ins_message``:
      code 3 MESSAGE_UNAVAILABLE, from the SuperLink's node id) and is deleted. (A real
      SuperLink answers code 3 again whenever asked for an id it no longer holds; here an
      unknown id yields nothing, so a transport that keeps asking is visible in
      ``pull_requests`` instead.)
    """

    def __init__(
        self,
        clock: FakeClock,
        nodes: dict[int, NodeFn] | None = None,
        *,
        appear_at: dict[int, float] | None = None,
        delay: Callable[[int, Message], float] | None = None,
    ) -> None:
        self.clock = clock
        self.nodes: dict[int, NodeFn] = dict(nodes or {})
        self.appear_at = dict(appear_at or {})
        self.delay = delay or (lambda node_id, message: 0.0)
        self.stored: dict[str, Stored] = {}
        self.pushes: list[list[Message]] = []
        self.pull_requests: list[list[str]] = []
        self.delivered: list[tuple[Message, Message]] = []  # (instruction, reply) pulled
        self.errors: list[Message] = []  # SuperLink-generated error replies pulled
        self._run: Run | None = None

    # Grid ---------------------------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        assert self._run is not None
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> list[int]:
        now = self.clock.now()
        return [n for n in self.nodes if self.appear_at.get(n, 0.0) <= now]

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        batch = list(messages)
        self.pushes.append(batch)
        connected = set(self.get_node_ids())
        ids = []
        for message in batch:
            message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            meta = message.metadata
            assert meta.message_id and meta.reply_to_message_id == "" and meta.ttl > 0
            if meta.dst_node_id not in connected:
                continue
            reply = self.nodes[meta.dst_node_id](message)
            if reply is not None:
                assert reply.metadata.reply_to_message_id == meta.message_id
            now = self.clock.now()
            self.stored[meta.message_id] = Stored(
                message, now, reply, now + self.delay(meta.dst_node_id, message)
            )
            ids.append(meta.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        ids = list(message_ids)
        self.pull_requests.append(ids)
        now = self.clock.now()
        out: list[Message] = []
        for message_id in ids:
            held = self.stored.get(message_id)
            if held is None:
                continue
            if now >= held.expires_at:  # Flower drops the instruction and any reply to it
                error = create_message_error_unavailable_ins_message(message_id, 1)
                out.append(error)
                self.errors.append(error)
            elif held.reply is not None and held.ready_at <= now:
                out.append(held.reply)
                self.delivered.append((held.instruction, held.reply))
            else:
                continue
            del self.stored[message_id]
        return out

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        return self.pull_messages(self.push_messages(messages))

    # for the tests --------------------------------------------------------------------
    def pushed(self) -> list[Message]:
        return [m for batch in self.pushes for m in batch]

    def asked_after(self, pull: int) -> set[str]:
        """Every message id the transport asked about in pulls number ``pull`` and later."""
        return {i for ids in self.pull_requests[pull:] for i in ids}


def silent(message: Message) -> None:
    """A node that never answers."""
    return None


def lensemble_node(node_id: int, *, sender: str | None = None) -> NodeFn:
    """Answers a train instruction as a lensemble participant does: a commitment when the
    RoundOpen asks for one, then an update of 0.25 everywhere (sent as ``sender``)."""
    pid = sender or participant_id(node_id)

    def answer(message: Message) -> Message:
        payloads = records.decode_instruction(message.content)
        opened = from_wire(payloads[-1])
        assert isinstance(opened, RoundOpen)
        common = {
            "run_id": opened.run_id,
            "round": opened.round,
            "attempt": opened.attempt,
            "sender": pid,
            "participant_id": pid,
        }
        sent: list[Any] = []
        if opened.needs_commitment:
            sent.append(Commitment(**common, dataset_root=ROOT, num_examples=8))
        delta = {n: np.full_like(a, 0.25) for n, a in opened.params.items()}
        sent.append(
            Update(**common, dataset_root=ROOT, delta=delta, l2_norm=l2_norm(delta), num_examples=8)
        )
        content = records.encode_reply([to_wire(m) for m in sent], {"num-examples": 8})
        return Message(content, reply_to=message)

    return answer


def quickstart_node(message: Message) -> Message:
    """A stock Message-API ClientApp's train: adds 1.5 to every array it was sent."""
    trained = {n: Array(a.numpy() + 1.5) for n, a in message.content["arrays"].items()}
    metrics = MetricRecord({"num-examples": 32, "train_loss": 0.75})
    return Message(
        RecordDict({"arrays": ArrayRecord(trained), "metrics": metrics}), reply_to=message
    )


def round_open(round: int = 1, *, attempt: int = 1, needs_commitment: bool = True) -> RoundOpen:
    return RoundOpen(
        run_id="run",
        round=round,
        sender=COORDINATOR,
        attempt=attempt,
        global_hash=HASH,
        params=PARAMS,
        sketch_seed=5,
        h_steps=2,
        needs_commitment=needs_commitment,
    )


def round_close(round: int = 1) -> RoundClose:
    return RoundClose(
        run_id="run",
        round=round,
        sender=COORDINATOR,
        previous_hash=ROOT,
        global_hash=HASH,
        count=2,
        record_hash="ef" * 32,
    )


def make_transport(grid: FakeGrid, clock: FakeClock, **kwargs: Any) -> GridTransport:
    kwargs.setdefault("message_ttl", 30.0)
    kwargs.setdefault("poll_interval", 0.05)
    return GridTransport(grid, clock=clock.now, sleep=clock.sleep, **kwargs)


def drain(transport: GridTransport, timeout_s: float = 0.0) -> list[dict[str, Any]]:
    out = []
    while (payload := transport.recv(timeout_s=timeout_s)) is not None:
        out.append(dict(payload))
    return out


# -- (a) deadlines ------------------------------------------------------------------------
def test_recv_returns_none_at_the_deadline_and_never_sleeps_past_it() -> None:
    clock = FakeClock()
    grid = FakeGrid(clock, {11: silent})
    transport = make_transport(grid, clock, poll_interval=0.3)
    transport.send("node-11", round_open())
    clock.t = 5.0

    assert transport.recv(timeout_s=1.0) is None
    assert clock.t == pytest.approx(6.0)
    assert clock.t <= 6.0 + 1e-9
    assert clock.sleeps and max(clock.sleeps) <= 0.3
    assert clock.sleeps[-1] < 0.3  # the last wait is cut to what was left
    assert len(grid.pull_requests) >= 3  # it kept polling while it waited


def test_recv_with_a_poll_interval_longer_than_the_timeout_waits_only_the_timeout() -> None:
    clock = FakeClock()
    transport = make_transport(FakeGrid(clock, {11: silent}), clock, poll_interval=10.0)
    transport.send("node-11", round_open())
    assert transport.recv(timeout_s=0.4) is None
    assert clock.t == pytest.approx(0.4) and clock.sleeps == [pytest.approx(0.4)]


def test_recv_returns_a_reply_as_soon_as_it_is_pullable() -> None:
    clock = FakeClock()
    grid = FakeGrid(clock, {11: lensemble_node(11)}, delay=lambda n, m: 1.0)
    transport = make_transport(grid, clock, poll_interval=0.1)
    transport.send("node-11", round_open(needs_commitment=False))
    payload = transport.recv(timeout_s=10.0)
    assert payload is not None and isinstance(from_wire(payload), Update)
    assert 1.0 <= clock.t < 1.0 + 0.1 + 1e-9


# -- (b), (c) pushing -----------------------------------------------------------------------
def test_sends_are_pushed_in_one_batch_by_the_next_recv() -> None:
    clock = FakeClock()
    grid = FakeGrid(clock, {n: lensemble_node(n) for n in (11, 12, 13)})
    transport = make_transport(grid, clock)
    for peer in transport.peers():
        transport.send(peer, round_open())
    assert grid.pushes == []  # send only queues

    first = transport.recv(timeout_s=1.0)
    assert first is not None
    assert len(grid.pushes) == 1
    assert sorted(m.metadata.dst_node_id for m in grid.pushes[0]) == [11, 12, 13]
    rest = drain(transport)
    assert len(rest) == 5  # 3 commitments and 3 updates in all
    assert len(grid.pushes) == 1  # later recvs had nothing to push


def test_every_instruction_carries_the_message_ttl_and_its_round_as_group() -> None:
    clock = FakeClock()
    grid = FakeGrid(clock, {11: silent, 12: silent})
    transport = make_transport(grid, clock, message_ttl=17.5)
    for rnd in (1, 3):
        for peer in ("node-11", "node-12"):
            transport.send(peer, round_open(rnd))
        transport.recv(timeout_s=0.0)
    pushed = grid.pushed()
    assert len(pushed) == 4
    assert {m.metadata.ttl for m in pushed} == {17.5}
    assert [m.metadata.group_id for m in pushed] == ["1", "1", "3", "3"]
    assert {m.metadata.message_type for m in pushed} == {MessageType.TRAIN}
    assert [m.content["config"]["server-round"] for m in pushed] == [1, 1, 3, 3]


def test_a_message_the_grid_refuses_does_not_derail_the_others() -> None:
    """InMemoryGrid leaves a refused message (e.g. a node that left) out of the ids it
    returns; the others must still be matched to their instructions."""
    clock = FakeClock()
    grid = FakeGrid(clock, {11: lensemble_node(11)})
    transport = make_transport(grid, clock)
    transport.send("node-99", round_open(needs_commitment=False))  # not a connected node
    transport.send("node-11", round_open(needs_commitment=False))
    payload = transport.recv(timeout_s=1.0)
    assert payload is not None and payload["sender"] == "node-11"
    assert transport.recv(timeout_s=1.0) is None


# -- (d), (e) late and expired instructions ---------------------------------------------------
def test_a_late_reply_of_an_earlier_round_is_pulled_decoded_and_returned() -> None:
    clock = FakeClock()
    grid = FakeGrid(
        clock,
        {11: lensemble_node(11), 12: silent},
        delay=lambda node, m: 5.0 if m.metadata.group_id == "1" else 0.0,
    )
    transport = make_transport(grid, clock)
    transport.send("node-11", round_open(1, needs_commitment=False))
    assert transport.recv(timeout_s=1.0) is None  # round 1 ends without node-11's reply
    (late_id,) = [m.metadata.message_id for m in grid.pushes[0]]

    transport.send("node-12", round_open(2))  # round 2 is being received
    payload = transport.recv(timeout_s=10.0)
    assert payload is not None
    assert clock.t == pytest.approx(5.0, abs=0.06)
    late = from_wire(payload)
    assert isinstance(late, Update) and late.round == 1 and late.sender == "node-11"

    # pulled means gone: from the grid, and from what the transport asks about
    assert late_id not in grid.stored
    asked_before = len(grid.pull_requests)
    assert transport.recv(timeout_s=1.0) is None
    assert late_id not in grid.asked_after(asked_before)
    assert [m.metadata.group_id for m in (s.instruction for s in grid.stored.values())] == ["2"]


def test_an_expired_instruction_yields_one_refusal_and_is_forgotten() -> None:
    clock = FakeClock()
    grid = FakeGrid(clock, {11: silent, 12: lensemble_node(12)})
    transport = make_transport(grid, clock, message_ttl=5.0)
    transport.send("node-11", round_open())
    refusal = transport.recv(timeout_s=6.0)  # the SuperLink's error: node-11 will not answer
    assert refusal is not None and refusal["kind"] == "refusal"
    assert refusal["sender"] == "node-11" and "from the SuperLink" in refusal["reason"]
    (expired_id,) = [m.metadata.message_id for m in grid.pushes[0]]

    assert [e.error.code for e in grid.errors] == [ErrorCode.MESSAGE_UNAVAILABLE]
    assert grid.errors[0].metadata.reply_to_message_id == expired_id
    assert transport.dropped == [("node-11", 1, "error 3")]
    assert grid.stored == {}

    # forgotten (well before the 2 x TTL horizon at which it would be forgotten anyway)
    asked_before = len(grid.pull_requests)
    transport.send("node-12", round_open(2, needs_commitment=False))
    payload = transport.recv(timeout_s=1.0)
    assert payload is not None and payload["sender"] == "node-12"
    assert transport.recv(timeout_s=1.0) is None
    assert clock.t < 2 * 5.0
    assert expired_id not in grid.asked_after(asked_before)


def test_a_clientapp_error_reply_is_that_nodes_refusal_of_the_attempt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()

    def crashing(message: Message) -> Message:
        return Message(
            Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="KeyError: 'lr'"),
            reply_to=message,
        )

    grid = FakeGrid(clock, {11: crashing})
    transport = make_transport(grid, clock)
    transport.send("node-11", round_open(2))
    with caplog.at_level("WARNING"):
        refusal = transport.recv(timeout_s=1.0)
    assert clock.t == 0.0  # at once: nothing waits for a node that already failed
    refused = from_wire(refusal)
    assert refused.participant_id == "node-11" and (refused.round, refused.attempt) == (2, 1)
    assert "KeyError: 'lr'" in refused.reason
    assert transport.dropped == [("node-11", 2, f"error {ErrorCode.CLIENT_APP_RAISED_EXCEPTION}")]
    assert grid.stored == {}
    assert caplog.text.count("KeyError: 'lr'") == 1  # logged once, with the node


# -- (f), (g) what replies become ----------------------------------------------------------
def test_a_stock_reply_becomes_an_unbound_update_with_the_right_delta() -> None:
    clock = FakeClock()
    grid = FakeGrid(clock, {11: quickstart_node})
    transport = make_transport(grid, clock)
    transport.send("node-11", round_open(4, attempt=2))
    payload = transport.recv(timeout_s=1.0)
    assert payload is not None and transport.recv(timeout_s=0.0) is None

    update = from_wire(payload)
    assert isinstance(update, Update)
    assert update.dataset_root is None
    assert update.transforms == ("stock-clientapp",)
    assert (update.round, update.attempt, update.run_id) == (4, 2, "run")
    assert update.sender == update.participant_id == "node-11"
    assert update.num_examples == 32
    assert sorted(update.delta) == sorted(PARAMS)
    for name, array in update.delta.items():
        assert array.dtype == np.float32
        np.testing.assert_allclose(array, np.full_like(PARAMS[name], 1.5))
    assert update.l2_norm == pytest.approx(l2_norm(update.delta))
    metrics = transport.traffic.client_metrics[(4, "node-11")]
    assert metrics == {"num-examples": 32.0, "train_loss": 0.75}


def _stock_reply(message: Message, arrays: dict[str, np.ndarray], metrics: dict) -> Message:
    """A stock train reply; ``{"n": k}`` stands for ``{"num-examples": k}``."""
    if "n" in metrics:
        metrics = {"num-examples": metrics["n"]}
    content = RecordDict({"arrays": ArrayRecord({n: Array(a) for n, a in arrays.items()})})
    content["metrics"] = MetricRecord(metrics)
    return Message(content, reply_to=message)


_MALFORMED: dict[str, tuple[NodeFn, str]] = {
    "neither kind": (
        lambda m: Message(RecordDict({"config": ConfigRecord({"x": 1})}), reply_to=m),
        "neither a lensemble nor a stock train reply",
    ),
    "metrics as a ConfigRecord": (
        lambda m: Message(
            RecordDict(
                {
                    "arrays": ArrayRecord({n: Array(a) for n, a in PARAMS.items()}),
                    "metrics": ConfigRecord({"num-examples": "32"}),
                }
            ),
            reply_to=m,
        ),
        "ConfigRecord 'metrics' ['num-examples']",  # says where the metrics went
    ),
    "no example count": (
        lambda m: _stock_reply(m, PARAMS, {"train_loss": 0.5}),
        "MetricRecord 'metrics' ['train_loss']",  # says what it holds, and what is needed
    ),
    "a wrong shape": (
        lambda m: _stock_reply(
            m, {**PARAMS, "w": np.zeros((5, 5), np.float32)}, {"num-examples": 3}
        ),
        "array 'w' has shape (5, 5); the model's has (2, 3)",
    ),
    "other arrays": (
        lambda m: _stock_reply(m, {"w": PARAMS["w"], "extra": np.ones(2, np.float32)}, {"n": 3}),
        "its arrays are not the model's: missing ['b'], unexpected ['extra']",
    ),
    "NaN": (
        lambda m: _stock_reply(
            m, {**PARAMS, "b": np.array([np.nan, 1], np.float32)}, {"num-examples": 3}
        ),
        "array 'b' holds NaN or infinite values",
    ),
    "an integer array": (  # cast to float32, it became a silently collapsed model
        lambda m: _stock_reply(
            m, {**PARAMS, "w": PARAMS["w"].astype(np.int64)}, {"num-examples": 3}
        ),
        "array 'w' has dtype int64; the model's has float32",
    ),
    "a negative example count": (
        lambda m: _stock_reply(m, PARAMS, {"num-examples": -200}),
        "MetricRecord 'metrics' ['num-examples'] (num-examples = -200)",
    ),
    "many arrays that are not the model's": (
        lambda m: _stock_reply(
            m,
            {**PARAMS, **{f"extra{i}": np.ones(2, np.float32) for i in range(10)}},
            {"num-examples": 3},
        ),
        "unexpected ['extra0', 'extra1', 'extra2', 'extra3', 'extra4', 'extra5', 'extra6', "
        "'extra7'] and 2 more",
    ),
}


@pytest.mark.parametrize("case", sorted(_MALFORMED))
def test_a_malformed_reply_is_that_nodes_refusal_at_once(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A reply that cannot become an update is the node's answer all the same: the round
    stops waiting for it (as for an error reply), and the reason says what was wrong."""
    clock = FakeClock()
    node, reason = _MALFORMED[case]
    transport = make_transport(FakeGrid(clock, {11: node}), clock)
    transport.send("node-11", round_open(3, attempt=2))
    refusal = transport.recv(timeout_s=5.0)
    assert clock.t == 0.0  # at once
    refused = from_wire(refusal)
    assert isinstance(refused, Refusal) and refused.error == "MalformedReply"
    assert refused.participant_id == "node-11" and (refused.round, refused.attempt) == (3, 2)
    assert reason in refused.reason
    if case in ("neither kind", "no example count", "metrics as a ConfigRecord"):
        assert "'num-examples'" in refused.reason and "weighted_by_key" in refused.reason
    assert [d[:2] for d in transport.dropped] == [("node-11", 3)]
    assert transport.recv(timeout_s=0.0) is None


def test_only_a_reply_to_a_round_open_stands_for_the_nodes_part() -> None:
    """A bad reply to anything but a RoundOpen (an unmask request) is only dropped and
    logged: it is not the node's refusal of the attempt."""
    info = SentInstruction(
        peer="node-11",
        kind=MessageKind.UNMASK_REQUEST,
        round=1,
        attempt=1,
        run_id="run",
        params=None,
        pushed_at=0.0,
    )
    assert malformed_refusal(info, "whatever") is None
    open_info = dataclasses.replace(info, kind=MessageKind.ROUND_OPEN)
    assert from_wire(malformed_refusal(open_info, "whatever")).error == "MalformedReply"


@pytest.mark.parametrize(
    ("sender", "returned"),
    [("node-11", True), ("partition-id-3", True), ("node-12", False), ("coordinator", False)],
)
def test_a_lensemble_reply_is_returned_only_when_its_sender_is_the_node_it_came_from(
    sender: str, returned: bool
) -> None:
    """A node may name itself once (its stable participant id); it may not take another
    node's address or the coordinator's name."""
    clock = FakeClock()
    grid = FakeGrid(clock, {11: lensemble_node(11, sender=sender), 12: silent})
    transport = make_transport(grid, clock)
    renamed: list[tuple[str, str]] = []
    transport.on_rename = lambda old, new: renamed.append((old, new)) is None  # accepted
    transport.send("node-11", round_open())
    payloads = drain(transport, timeout_s=1.0)
    if returned:
        assert [type(from_wire(p)) for p in payloads] == [Commitment, Update]
        assert {p["sender"] for p in payloads} == {sender}
        assert transport.dropped == []
        assert renamed == ([] if sender == "node-11" else [("node-11", sender)])
        assert sender in transport.peers()  # addressed by its own name from now on
        pushes = len(grid.pushes)
        transport.send(sender, round_open(2, needs_commitment=False))
        transport.recv(timeout_s=0.0)
        assert len(grid.pushes) == pushes + 1 and grid.pushes[-1][0].metadata.dst_node_id == 11
    else:  # node-11 answered with another's name: its refusal, not the other's update
        refused = [from_wire(p) for p in payloads]
        assert [(r.error, r.participant_id) for r in refused] == [("MalformedReply", "node-11")]
        assert sender in refused[0].reason
        assert [d[:2] for d in transport.dropped] == [("node-11", 1)]
        assert sender in transport.dropped[0][2]
    assert grid.stored == {}


# -- (h), (i) RoundClose piggyback and exchanges ------------------------------------------------
def test_a_broadcast_close_rides_on_the_next_instruction_close_first() -> None:
    clock = FakeClock()
    grid = FakeGrid(clock, {11: silent, 12: silent})
    transport = make_transport(grid, clock)
    transport.send("node-11", round_open(1))
    transport.recv(timeout_s=0.0)
    assert records.CLOSE_PREFIX + "kind" not in grid.pushed()[0].content["config"]

    closed = round_close(1)
    transport.broadcast(closed)
    assert grid.pushes and len(grid.pushed()) == 1  # a broadcast costs no exchange

    opened = round_open(2, needs_commitment=False)
    for peer in ("node-11", "node-12"):
        transport.send(peer, opened)
    transport.recv(timeout_s=0.0)
    for message in grid.pushes[-1]:
        assert list(message.content.config_records) == ["config"]  # one, as mods expect
        assert records.CLOSE_PREFIX + "kind" in message.content["config"]
        got_close, got_open = (from_wire(p) for p in records.decode_instruction(message.content))
        assert got_close == closed
        assert isinstance(got_open, RoundOpen) and got_open.round == 2
        assert got_open.global_hash == opened.global_hash and not got_open.needs_commitment


def test_only_round_opens_are_sent_and_only_round_closes_broadcast() -> None:
    clock = FakeClock()
    transport = make_transport(FakeGrid(clock, {11: silent}), clock)
    with pytest.raises(ValueError, match="RoundOpen"):
        transport.send("node-11", round_close())
    with pytest.raises(ValueError, match="RoundClose"):
        transport.broadcast(round_open())


def test_exchanges_counts_instructions_per_busiest_node() -> None:
    clock = FakeClock()
    grid = FakeGrid(clock, {n: silent for n in (11, 12, 13)})
    transport = make_transport(grid, clock)
    for peer in transport.peers():
        transport.send(peer, round_open(1))
    transport.recv(timeout_s=0.0)
    assert transport.exchanges(1) == 1
    assert transport.exchanges(2) == 0

    transport.send("node-12", round_open(1, attempt=2))  # a retried attempt: a second one
    assert transport.exchanges(1) == 2


def test_a_reply_collector_keeps_what_is_sent_until_it_is_taken() -> None:
    """The participant's transport in ``handle_train`` (and in a shared-folder process):
    sends and broadcasts are kept in order and handed over once, as wire payloads."""
    collector = ReplyCollector()
    collector.send(COORDINATOR, round_close(1))
    collector.broadcast(round_close(2))
    assert collector.recv(timeout_s=5.0) is None
    assert collector.peers() == [COORDINATOR]
    assert collector.take() == [to_wire(round_close(1)), to_wire(round_close(2))]
    assert collector.take() == [] and collector.sent == []
    assert app_module.ReplyCollector is ReplyCollector  # still importable from the app


# -- (k) end to end: a Coordinator over a GridTransport over the FakeGrid -----------------------
NODES = (11, 12, 13, 14)


def clientapp_node(
    index: int, context: Context, config: LensembleConfig, identity: IdentityKey | None = None
) -> NodeFn:
    """A node running ``handle_train`` as ``make_client_app``'s train function does: a
    fresh trainer per message, the participant's state kept in the node's Context."""

    def answer(message: Message) -> Message:
        return handle_train(message, context, ToyTrainer(index), config, identity=identity)

    return answer


def federation_over_grid(
    run_dir: Path,
    delay: Callable[[int, Message], float],
    *,
    identities: dict[int, IdentityKey] | None = None,
    **federation: Any,
) -> tuple[Coordinator, GridTransport, FakeGrid, dict[int, Context]]:
    """Four ``handle_train`` nodes on a FakeGrid and their coordinator; ``identities``:
    the nodes that sign their messages, with their keys."""
    config = small_config(min_participants=3, **federation)
    clock = FakeClock()
    contexts = {
        n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
        for n in NODES
    }
    nodes = {
        n: clientapp_node(i, contexts[n], config, (identities or {}).get(n))
        for i, n in enumerate(NODES)
    }
    grid = FakeGrid(clock, nodes, delay=delay)
    fed = config.federation
    names = NodeNames()  # what the strategy's first exchange teaches it: who signs as whom
    for node, key in (identities or {}).items():
        names.learn(node, f"key-{key.fingerprint}")
    transport = make_transport(
        grid, clock, message_ttl=fed.open_timeout + fed.collect_timeout, names=names
    )
    coordinator = Coordinator(
        config,
        transport=transport,
        initial_params=initial_params(),
        store=Store(run_dir),
        run_id="flwr-1",
    )
    return coordinator, transport, grid, contexts


def exchanges_of(grid: FakeGrid, rnd: int) -> dict[int, list[Message]]:
    """The replies pulled for round ``rnd``'s instructions, by node."""
    out: dict[int, list[Message]] = {}
    for instruction, reply in grid.delivered:
        if instruction.metadata.group_id == str(rnd):
            out.setdefault(instruction.metadata.dst_node_id, []).append(reply)
    return out


def assert_steady_state(grid: FakeGrid, transport: GridTransport, rnd: int) -> None:
    """Round ``rnd`` was one exchange per node, with no commitment in it, and every
    instruction carried the previous round's close."""
    assert transport.exchanges(rnd) == 1
    replies = exchanges_of(grid, rnd)
    assert sorted(replies) == list(NODES)
    for node_replies in replies.values():
        (reply,) = node_replies
        assert UPDATE in reply.content.config_records
        assert COMMITMENT not in reply.content.config_records
    for message in grid.pushed():
        if message.metadata.group_id == str(rnd):
            first = records.decode_instruction(message.content)[0]
            assert (kind_of(first), first["round"]) == (MessageKind.ROUND_CLOSE, rnd - 1)


def test_end_to_end_three_rounds_over_the_grid(tmp_path: Path) -> None:
    coordinator, transport, grid, contexts = federation_over_grid(
        tmp_path / "run", delay=lambda node, m: 1.0
    )
    coordinator.run(3)

    everyone = tuple(participant_id(n) for n in NODES)
    assert [o.state for o in coordinator.outcomes] == [RoundState.CLOSED] * 3
    assert [o.count for o in coordinator.outcomes] == [len(NODES)] * 3
    assert all(o.contributors == everyone and o.late == () for o in coordinator.outcomes)
    assert [len(batch) for batch in grid.pushes] == [len(NODES)] * 3  # one push per round
    # every node of a round gets the same encoded instruction (FedAvg shares one too)
    assert [len({id(m.content) for m in batch}) for batch in grid.pushes] == [1, 1, 1]

    first = exchanges_of(grid, 1)  # round 1 binds: commitment and update in one reply
    assert sorted(first) == list(NODES)
    assert all(COMMITMENT in r.content.config_records for (r,) in first.values())
    for rnd in (2, 3):
        assert_steady_state(grid, transport, rnd)

    ledger = verify(Store(tmp_path / "run"))
    assert [r.round for r in ledger] == [1, 2, 3]
    assert all(r.contributors == everyone for r in ledger)
    assert all(root is not None for r in ledger for root in r.dataset_roots.values())
    assert ledger[-1].new_global_hash == coordinator.global_state().params_hash
    assert grid.stored == {} and transport.dropped == []
    assert grid.clock.t < 3 * 2.0  # no round waited for its deadline
    # each node's participant state outlived its messages, in its Context
    assert all(load_state(c.state).meta["last_open"][:2] == [3, 1] for c in contexts.values())


def test_a_node_silent_for_a_round_trains_again_the_next_over_the_grid(tmp_path: Path) -> None:
    """Plaintext: node-11 does not answer round 2's instruction (the round closes with
    the other three at its deadline) and answers round 3's: round 3 takes it back on its
    first attempt (the masked case: tests/coordinator/test_masked_rounds.py)."""
    coordinator, _transport, grid, _ = federation_over_grid(
        tmp_path / "run", delay=lambda node, m: 1.0
    )
    answer = grid.nodes[NODES[0]]

    def silent_in_round_two(message: Message) -> Message | None:
        for payload in records.decode_instruction(message.content):
            if kind_of(payload) is MessageKind.ROUND_OPEN and payload["round"] == 2:
                return None
        return answer(message)

    grid.nodes[NODES[0]] = silent_in_round_two
    coordinator.run(3)
    assert [(o.state, o.count) for o in coordinator.outcomes] == [
        (RoundState.CLOSED, 4),
        (RoundState.CLOSED, 3),
        (RoundState.CLOSED, 4),
    ]
    ledger = verify(Store(tmp_path / "run"))
    assert [(r.round, r.attempt) for r in ledger] == [(1, 1), (2, 1), (3, 1)]
    assert participant_id(NODES[0]) in ledger[-1].contributors


@pytest.mark.parametrize("failure", ["error", "malformed"])
def test_a_signing_nodes_failed_reply_ends_its_wait_at_once(
    tmp_path: Path, failure: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Nodes that sign with identity keys: the Refusal a transport files for one whose
    ClientApp raised, or whose reply was malformed, carries no signature of the node, and
    is taken all the same (the coordinator's own transport saw the reply), so the round
    does not wait its deadline out. It stops nothing, and is recorded as such."""
    keys = {n: IdentityKey.generate() for n in NODES}
    coordinator, _transport, grid, _ = federation_over_grid(
        tmp_path / "run", delay=lambda node, m: 1.0, identities=keys, require_signatures=True
    )
    coordinator.run(1)  # every node binds its key

    def failing(message: Message) -> Message:
        if failure == "error":
            return Message(
                Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="KeyError: 'lr'"),
                reply_to=message,
            )
        return Message(RecordDict({"config": ConfigRecord({"x": 1})}), reply_to=message)

    grid.nodes[14] = failing
    started = grid.clock.t
    with caplog.at_level("WARNING"):
        coordinator.run(1)
    outcome = coordinator.outcomes[-1]
    assert outcome.state is RoundState.CLOSED and outcome.count == 3
    assert grid.clock.t - started < 5.0  # the collect deadline is 10 s: nobody waited it out
    assert "ForgedMessage" not in caplog.text
    if failure == "error":  # logged once, by the transport, with the node
        assert caplog.text.count("KeyError: 'lr'") == 1
    (entry,) = [r for r in verify(Store(tmp_path / "run")) if r.round == 2]
    assert f"key-{keys[14].fingerprint}" not in entry.contributors


def huge_update_node(message: Message) -> Message:
    """A stock train whose update the coordinator refuses (|value| past what the exact
    sum takes for one update: ``max-abs-update``, unset, is 2**20 here)."""
    trained = {n: Array(a.numpy() + 1e7) for n, a in message.content["arrays"].items()}
    metrics = MetricRecord({"num-examples": 32})
    return Message(
        RecordDict({"arrays": ArrayRecord(trained), "metrics": metrics}), reply_to=message
    )


def test_a_node_whose_update_is_rejected_has_answered_all_the_same(tmp_path: Path) -> None:
    """The coordinator rejects node 14's update: node 14 answered, and will not answer
    again, so the round closes with the others at once instead of at its deadline, and
    the closing entry says why node 14 contributed nothing."""
    coordinator, _transport, grid, _ = federation_over_grid(
        tmp_path / "run", delay=lambda node, m: 1.0
    )
    grid.nodes[14] = huge_update_node
    coordinator.run(1)
    outcome = coordinator.outcomes[-1]
    assert outcome.state is RoundState.CLOSED and outcome.count == 3
    assert grid.clock.t < 5.0  # the collect deadline is 10 s
    (record,) = verify(Store(tmp_path / "run"))
    assert participant_id(14) not in record.contributors


def test_when_every_update_is_rejected_the_run_says_why_at_once(tmp_path: Path) -> None:
    """Two of four nodes' updates rejected with a quorum of 3: the attempt aborts as soon
    as the quorum is out of reach, and its error names the rejection, so that the run's
    final status says what to change."""
    coordinator, _transport, grid, _ = federation_over_grid(
        tmp_path / "run", delay=lambda node, m: 1.0, max_round_attempts=1
    )
    grid.nodes[13] = grid.nodes[14] = huge_update_node
    with pytest.raises(FaultToleranceExceeded) as caught:
        coordinator.run(1)
    assert grid.clock.t < 5.0
    assert "2 updates and nobody left to answer, quorum 3" in str(caught.value)
    assert "2 answered without an update" in str(caught.value)
    assert "exceeds max_abs_update" in str(caught.value)
    assert "set lensemble.max-abs-update" in str(caught.value)  # and what to change


def test_a_rejection_waits_when_no_transport_vouches_for_the_sender(tmp_path: Path) -> None:
    """In process anyone may write any sender into a payload: a rejected update that did
    not come through a transport that authenticates its sender leaves that participant
    free to answer (nobody can shut another out by sending junk in its name)."""
    coordinator = Coordinator(
        small_config(min_participants=1),
        initial_params=initial_params(),
        store=Store(tmp_path / "run"),
        run_id="run",
    )
    attempt = coordinator.begin_attempt()
    coordinator.invite(["p00"])
    junk = {
        "kind": MessageKind.UPDATE.value,
        "run_id": "run",
        "round": attempt.round,
        "attempt": attempt.number,
        "sender": "p00",
        "participant_id": "p00",
    }
    assert coordinator.receive(junk) is None
    assert attempt.rejected == 1 and not attempt.refused
    vouched = DeliveredFrom(junk, peer="p00", round=attempt.round, attempt=attempt.number)
    assert coordinator.receive(vouched) is None
    assert list(attempt.refused) == ["p00"] and "RejectedUpdate" in attempt.refused["p00"]
    other = DeliveredFrom(junk, peer="p00", round=attempt.round, attempt=attempt.number + 1)
    del attempt.refused["p00"]
    assert coordinator.receive(other) is None and not attempt.refused  # another attempt's


def test_a_forged_refusal_from_the_wire_still_needs_a_signature(tmp_path: Path) -> None:
    """Only a Refusal the transport itself files skips the node's signature: the same
    payload arriving as a node's own reply content is checked like any message."""
    keys = {n: IdentityKey.generate() for n in NODES}
    coordinator, _transport, _grid, _ = federation_over_grid(
        tmp_path / "run", delay=lambda node, m: 1.0, identities=keys, require_signatures=True
    )
    coordinator.run(1)
    coordinator.begin_attempt()
    attempt = coordinator._current()
    forged = {
        "kind": MessageKind.REFUSAL.value,
        "run_id": "flwr-1",
        "round": attempt.round,
        "attempt": attempt.number,
        "sender": f"key-{keys[12].fingerprint}",
        "participant_id": f"key-{keys[12].fingerprint}",
        "error": "ClientAppError",
        "reason": "forged",
    }
    assert coordinator.receive(forged) is None  # rejected: unsigned
    assert attempt.rejected == 1 and not attempt.refused
    # filed by the transport for a node that signed under that name before: taken
    assert coordinator.receive(FiledByTransport(forged, node=12)) is Verdict.REFUSED
    assert list(attempt.refused) == [f"key-{keys[12].fingerprint}"]
    del attempt.refused[f"key-{keys[12].fingerprint}"]
    # for another node claiming that name (squatting it while node 12 is away): refused
    assert coordinator.receive(FiledByTransport(forged, node=99)) is None
    assert coordinator.receive(FiledByTransport(forged)) is None
    assert not attempt.refused and attempt.rejected == 3
    # a participant that never signed from any node is vouched for by no node (not even None)
    unsigned = {**forged, "sender": "key-unknown", "participant_id": "key-unknown"}
    attempt.invited.add("key-unknown")
    assert coordinator.receive(FiledByTransport(unsigned)) is None
    assert not attempt.refused and attempt.rejected == 4


def test_a_rounds_files_are_made_after_its_instructions_are_pushed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GridTransport only queues what the coordinator sends: the coordinator flushes it
    before it makes the files its commit will write (``Store.prepare_writes``), so that
    making them delays no instruction, and the commit then makes none."""
    coordinator, _transport, grid, _ = federation_over_grid(
        tmp_path / "run", delay=lambda node, m: 1.0
    )
    events: list[str] = []
    real_push, real_prepare, real_take = grid.push_messages, Store.prepare_writes, Store._temp_file

    def push(messages: Iterable[Message]) -> Iterable[str]:
        events.append("push")
        return real_push(messages)

    def prepare(store: Store, count: int) -> None:
        events.append("prepare")
        real_prepare(store, count)

    def take(store: Store) -> tuple[int, str]:
        events.append("take" if store._spares else "make")
        return real_take(store)

    monkeypatch.setattr(grid, "push_messages", push)
    monkeypatch.setattr(Store, "prepare_writes", prepare)
    monkeypatch.setattr(Store, "_temp_file", take)
    coordinator.run(3)
    rounds = [e for e in events if e in ("push", "prepare")]
    assert rounds == ["push", "prepare"] * 3, events
    after_first = events[events.index("prepare") + 1 :]  # round 2 on: bound, plaintext
    assert "make" not in after_first[after_first.index("push") :], events


def test_end_to_end_a_late_node_is_dropped_then_contributes_again(tmp_path: Path) -> None:
    collect = small_config().federation.collect_timeout
    late_node = 14

    def delay(node: int, message: Message) -> float:
        # round 2: node 14's reply misses the collect deadline, and becomes pullable
        # while round 3 waits for the others' replies (1 s of compute)
        if (node, message.metadata.group_id) == (late_node, "2"):
            return collect + 0.5
        return 1.0

    coordinator, transport, grid, contexts = federation_over_grid(tmp_path / "run", delay)
    coordinator.run(3)

    everyone = tuple(participant_id(n) for n in NODES)
    others = tuple(p for p in everyone if p != participant_id(late_node))
    outcomes = coordinator.outcomes
    assert [o.state for o in outcomes] == [RoundState.CLOSED] * 3
    assert [o.round for o in outcomes] == [1, 2, 3]
    assert outcomes[1].contributors == others and outcomes[1].count == 3
    assert outcomes[1].elapsed >= collect  # the round waited for its deadline, no longer
    assert outcomes[1].late == ()
    assert outcomes[2].late == (participant_id(late_node),)  # its round-2 update, dropped
    assert outcomes[2].contributors == everyone and outcomes[2].count == len(NODES)

    # the late round-2 reply was pulled (so deleted) while round 3 was being received
    (late_reply,) = exchanges_of(grid, 2)[late_node]
    assert UPDATE in late_reply.content.config_records
    assert_steady_state(grid, transport, 3)

    ledger = verify(Store(tmp_path / "run"))
    assert [r.contributors for r in ledger] == [everyone, others, everyone]
    assert grid.stored == {} and transport.dropped == []
    assert all(load_state(c.state).meta["last_open"][:2] == [3, 1] for c in contexts.values())


def test_only_the_simulation_engine_declares_how_many_nodes_the_federation_has() -> None:
    """Flower's simulation engine (an InMemoryGrid) has every node from the start, so a
    quorum above their number is refused before round 1; a deployment's grid may see more
    nodes later, so it declares nothing and the open timeout decides."""
    from flwr.superlink.grid import InMemoryGrid

    class SimulationGrid(InMemoryGrid):
        def __init__(self) -> None:  # no LinkState: only the node count is asked
            pass

        def get_node_ids(self) -> list[int]:
            return [11, 12, 13]

    clock = FakeClock()
    assert make_transport(SimulationGrid(), clock).declared_size() == 3  # type: ignore[arg-type]
    assert make_transport(FakeGrid(clock, {}), clock).declared_size() is None


def test_peers_stay_one_object_while_the_nodes_stay_the_same() -> None:
    """The coordinator reuses what it derived from the peers while the transport hands it
    the same tuple (``coordinator.reach``); a new node makes a new tuple."""
    clock = FakeClock()
    grid = FakeGrid(clock, {11: silent, 12: silent, 13: silent}, appear_at={13: 5.0})
    transport = make_transport(grid, clock, peer_refresh=1.0)
    first = transport.peers()
    assert first == ("node-11", "node-12") and isinstance(first, tuple)
    clock.sleep(2.0)  # refreshed from the Grid: the same nodes, the same object
    assert transport.peers() is first
    clock.sleep(4.0)
    assert transport.peers() == ("node-11", "node-12", "node-13")


def test_a_round_over_the_grid_invites_each_node_once_not_once_per_reply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The phase loop asks for invitations after every reply; with a peer list that is
    the same object it skips the ones it already made, so a round's invitation work is
    O(N), not O(N) per reply (O(N^2) per round: most of the ServerApp's CPU at N = 500)."""
    from lensemble_flwr.coordinator.modes import PlaintextMode

    calls: list[str] = []
    invitation = PlaintextMode.invitation

    def counted(self: PlaintextMode, attempt: Any, peer: str) -> Any:
        calls.append(peer)
        return invitation(self, attempt, peer)

    monkeypatch.setattr(PlaintextMode, "invitation", counted)
    # replies come in one at a time (node 11 after 0.1 s, ..., node 14 after 0.4 s)
    coordinator, _, _, _ = federation_over_grid(
        tmp_path / "run", delay=lambda node, m: 0.1 * (node - 10)
    )
    coordinator.run(3)
    assert [o.count for o in coordinator.outcomes] == [len(NODES)] * 3
    # a constant number of passes over the nodes per round (the first invites them; one
    # more per phase records that nobody is left to invite: 3 today), not one per reply
    # (100 calls before, for these 3 rounds of 4 nodes)
    assert len(calls) <= 3 * (4 * len(NODES)), len(calls)


def test_the_recipients_of_a_round_open_share_one_content_until_the_close_changes() -> None:
    """Every node of an attempt gets the same RoundOpen, so its instruction is encoded
    once and shared (FedAvg shares one RecordDict among its messages too); a RoundClose,
    another RoundOpen or another user config gives a new content, which carries it."""
    clock = FakeClock()
    grid = FakeGrid(clock, {11: silent, 12: silent, 13: silent})
    transport = make_transport(grid, clock)
    first = round_open(1)
    for node in (11, 12):
        transport.send(f"node-{node}", first)
    transport.recv(timeout_s=0.0)
    a, b = grid.pushes[-1]
    assert a.content is b.content and a.metadata.dst_node_id != b.metadata.dst_node_id
    transport.broadcast(round_close(1))
    second = round_open(2)
    transport.send("node-11", second)
    transport.send("node-13", second)
    transport.send("node-12", first)  # another RoundOpen again: encoded afresh
    transport.recv(timeout_s=0.0)
    c, d, e = grid.pushes[-1]
    assert c.content is d.content and c.content is not a.content
    assert records.decode_instruction(c.content)[0]["kind"] == "round-close"
    assert records.decode_instruction(c.content)[1]["round"] == 2
    assert e.content is not a.content and e.content is not c.content
    assert records.decode_instruction(e.content)[1]["round"] == 1
    transport.send("node-11", second)  # still the same close and config: shared
    transport.user_config["lr"] = 0.5  # a config changed in place: encoded afresh
    transport.send("node-13", second)
    transport.recv(timeout_s=0.0)
    f, g = grid.pushes[-1]
    assert f.content is c.content and g.content is not c.content
    assert records.instruction_user_config(g.content)["lr"] == 0.5
    assert "lr" not in records.instruction_user_config(f.content)


def test_the_encoded_contents_a_transport_keeps_are_bounded() -> None:
    """A sender of many distinct RoundOpens (a masked round's members each get their
    own) does not make the transport keep a content for each: past a few it starts
    afresh, and a RoundOpen it no longer keeps is simply encoded again."""
    clock = FakeClock()
    grid = FakeGrid(clock, {11: silent})
    transport = make_transport(grid, clock)
    opens = [round_open(r) for r in range(1, 11)]
    for message in opens:
        transport.send("node-11", message)
    transport.send("node-11", opens[0])  # dropped when the kept ones filled up
    transport.send("node-11", opens[-1])  # kept
    transport.recv(timeout_s=0.0)
    pushed = grid.pushes[-1]
    assert pushed[10].content is not pushed[0].content
    assert pushed[11].content is pushed[9].content
    assert len(transport._opens._encoded) <= ENCODED_KEPT
