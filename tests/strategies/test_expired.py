"""Instructions' TTL on Flower, and replies the coordinator no longer waits for: no
instruction goes out with a TTL Flower refuses, a late reply Flower drops for its spent
TTL and a "Message Unavailable" of an attempt no longer awaited are one INFO line per
attempt, and genuine errors still surface (fake Grid, fake clock: no Ray, no sleeping)."""

from __future__ import annotations

import logging

import pytest
from flwr.app import Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.common.logger import FLOWER_LOGGER
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
from flwr.server.utils.validator import validate_message
from flwr.supercore.date import now

from lensemble_flwr.coordinator.deadlines import PhaseDeadlines
from lensemble_flwr.strategies.expired import ExpiredReplies, expired_only
from lensemble_flwr.strategies.grid_transport import MIN_MESSAGE_TTL, instruction_ttl
from tests.strategies.test_grid_transport import (
    FakeClock,
    FakeGrid,
    _serverapp_identity,  # noqa: F401  (the autouse fixture, for this module too)
    lensemble_node,
    make_transport,
    round_open,
    silent,
)


def test_instruction_ttl_is_the_deadlines_and_grace_never_below_the_floor() -> None:
    fixed = PhaseDeadlines(60.0, 60.0, "fixed")
    assert instruction_ttl(fixed) == 120.0
    assert instruction_ttl(fixed, grace=25.0) == 145.0
    tiny = PhaseDeadlines(0.5, 1.0, "adaptive", "2 x 0.5 s")
    assert instruction_ttl(tiny) == MIN_MESSAGE_TTL > 0


@pytest.mark.parametrize("ttl", [0.0, -3.0, 0.2])
def test_no_instruction_is_sent_with_a_ttl_flower_refuses(ttl: float) -> None:
    """Whatever the TTL was set to (a deadline already spent), what goes out carries at
    least MIN_MESSAGE_TTL: RoundOpens, hook-made instructions and evaluation messages."""
    clock = FakeClock()
    grid = FakeGrid(clock, {11: silent, 12: silent})
    transport = make_transport(grid, clock, message_ttl=ttl)
    transport.send("node-11", round_open())
    transport.recv(timeout_s=0.0)
    evaluate = Message(RecordDict(), 12, "evaluate")
    transport.request_messages([evaluate], timeout_s=0.0)
    pushed = grid.pushed()
    assert len(pushed) == 2
    assert {m.metadata.ttl for m in pushed} == {MIN_MESSAGE_TTL}


def _spent_reply() -> Message:
    """A node's reply created after its instruction's TTL passed (its own TTL is spent)."""
    instruction = Message(RecordDict(), 11, "train", ttl=1.0)
    instruction.metadata.__dict__["_message_id"] = "ins-1"
    instruction.metadata.created_at = now().timestamp() - 10.0  # expired 9 s ago
    instruction.metadata.__dict__["_dst_node_id"] = 11
    reply = Message(RecordDict(), reply_to=instruction)
    reply.metadata.__dict__["_message_id"] = "res-1"
    return reply


def _store_as_the_superlink_does(reply: Message) -> None:
    """Flower's in-memory SuperLink (the simulation engine's) storing ``reply``: it
    validates it first, and logs the errors at ERROR (nothing else of it is needed)."""
    state = InMemoryLinkState.__new__(InMemoryLinkState)
    assert state.store_message_res(reply) is None  # refused


def test_flowers_errors_for_spent_replies_become_one_info_line_per_attempt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reply = _spent_reply()
    errors = validate_message(reply, is_reply_message=True)
    assert errors and set(errors) <= {
        "`metadata.ttl` must be higher than zero",
        "Message TTL has expired",
    }
    expired = ExpiredReplies()
    caplog.set_level(logging.DEBUG)
    FLOWER_LOGGER.propagate, propagated = True, FLOWER_LOGGER.propagate
    try:
        with expired.counting():
            for _ in range(9):  # Flower's own code path, nine late replies
                _store_as_the_superlink_does(reply)
            FLOWER_LOGGER.log(logging.ERROR, ["`metadata.run_id` is not set."])  # genuine
            FLOWER_LOGGER.log(logging.ERROR, [*errors, "empty `metadata.message_id`"])
            expired.say(2, 1)
            expired.say(2, 2)  # nothing new: no line
        _store_as_the_superlink_does(reply)  # the run is over: not held back any more
    finally:
        FLOWER_LOGGER.propagate = propagated
    flower = [r for r in caplog.records if r.name == "flwr"]
    held = [r for r in flower if r.levelno >= logging.ERROR and expired_only(r)]
    assert len(held) == 1  # only the one logged after the block
    genuine = [r for r in flower if r.levelno >= logging.ERROR and not expired_only(r)]
    assert [r.msg for r in genuine] == [
        ["`metadata.run_id` is not set."],
        [*errors, "empty `metadata.message_id`"],
    ]
    lines = [r.getMessage() for r in flower if r.levelno == logging.INFO]
    assert lines == [
        "round 2 attempt 1: 9 late replies dropped by Flower (their TTL had passed) and 0 "
        "expired instructions reported unavailable by the SuperLink, all of attempts no "
        "longer waited for"
    ]
    assert expired.total == 9 and expired.dropped == 0


def test_message_unavailable_of_an_attempt_no_longer_awaited_is_counted_not_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    grid = FakeGrid(clock, {11: silent, 12: lensemble_node(12), 13: silent})
    transport = make_transport(grid, clock, message_ttl=5.0)
    transport.send("node-11", round_open(1, attempt=1))
    assert transport.recv(timeout_s=1.0) is None  # attempt 1 aborts at its deadline
    transport.send("node-12", round_open(1, attempt=2, needs_commitment=False))
    transport.send("node-13", round_open(1, attempt=2, needs_commitment=False))
    assert transport.awaited == (1, 2)
    caplog.set_level(logging.INFO)
    got = []
    while (payload := transport.recv(timeout_s=6.0)) is not None:
        got.append(payload)
    # node-11's expired instruction of attempt 1: counted, no refusal, no warning
    assert [e.error.code for e in grid.errors] == [ErrorCode.MESSAGE_UNAVAILABLE] * 2
    assert transport.expired.unavailable == 1
    # node-13's of the awaited attempt 2 is still its refusal, with its warning
    refusals = [p for p in got if p["kind"] == "refusal"]
    assert [(p["sender"], p["attempt"]) for p in refusals] == [("node-13", 2)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "node-13 replied with an error" in warnings[0]
    assert grid.errors[0].metadata.src_node_id == SUPERLINK_NODE_ID


def test_once_its_driver_ended_an_attempt_its_unavailable_replies_are_only_counted() -> None:
    clock = FakeClock()
    grid = FakeGrid(clock, {11: silent})
    transport = make_transport(grid, clock, message_ttl=5.0)
    transport.send("node-11", round_open(1, attempt=1))
    transport.recv(timeout_s=0.0)
    transport.awaited = None  # what AttemptDriver does as the attempt ends
    assert transport.recv(timeout_s=6.0) is None
    assert transport.expired.unavailable == 1 and transport.expired.total == 1


def test_an_evaluation_message_lives_as_long_as_it_is_waited_for() -> None:
    clock = FakeClock()
    grid = FakeGrid(clock, {12: silent})
    transport = make_transport(grid, clock, message_ttl=20.0)
    transport.request_messages([Message(RecordDict(), 12, "evaluate")], timeout_s=90.0)
    assert [m.metadata.ttl for m in grid.pushed()] == [90.0]
    assert clock.t == pytest.approx(90.0, abs=0.1)  # waited its timeout, not its old TTL
