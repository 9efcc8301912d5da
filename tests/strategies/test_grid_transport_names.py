"""A Flower node's name is bound by a message signed for it: a node that claims another
participant's name, and cannot sign for it, binds nothing, answers for nobody else, and
keeps nobody out (fake Grid of ClientApps on a fake clock: no Ray, no real sleep)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from federation_helpers import small_config
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp.strategy import Strategy

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.identity.signing import IdentityKey
from lensemble_flwr.protocol.messages import Refusal, from_wire
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.simulations.toy import initial_params
from lensemble_flwr.strategies import LensembleStrategy, records
from lensemble_flwr.strategies.grid_transport import GridTransport
from lensemble_flwr.strategies.records import arrays_to_record
from lensemble_flwr.transports.base import DeliveredFrom
from tests.strategies.test_grid_transport import (  # noqa: F401  (the autouse fixture sets the ServerApp identity)
    NODES,
    FakeClock,
    FakeGrid,
    _serverapp_identity,
    clientapp_node,
    drain,
    lensemble_node,
    make_transport,
    round_open,
    silent,
)

OWN = {11: "org-x", 12: "org-b", 13: "org-c", 14: "org-d"}  # each node's own name
CLAIMANT, HONEST_NODE = 11, 12


def pid(name: str) -> str:
    """The participant id a node with ``lensemble-id = name`` gives itself."""
    return f"lensemble-id-{name}"


def named_grid(
    config: LensembleConfig,
    keys: dict[int, IdentityKey],
    names: dict[int, str],
    *,
    delayed: bool = True,
    claimant_after: float = 0.5,
) -> tuple[FakeGrid, dict[int, Context]]:
    """A fake Grid of lensemble ClientApps: node ``n`` names itself ``names[n]`` (its
    node config's ``lensemble-id``) and signs with ``keys[n]``; the claimant answers
    after ``claimant_after`` s, every other node after 1 s (``delayed=False``: all at
    once, in node order, the claimant first, as Flower's own loop needs them)."""
    contexts = {
        n: Context(
            run_id=1,
            node_id=n,
            node_config={"lensemble-id": names[n]},
            state=RecordDict(),
            run_config={},
        )
        for n in NODES
    }
    nodes = {n: clientapp_node(i, contexts[n], config, keys[n]) for i, n in enumerate(NODES)}

    def delay(node: int, message: Message) -> float:
        if not delayed:
            return 0.0
        return claimant_after if node == CLAIMANT else 1.0

    return FakeGrid(FakeClock(), nodes, delay=delay), contexts


def on_the_fake_clock(
    strategy: LensembleStrategy, grid: FakeGrid, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The strategy's transport waits on the grid's fake clock (a real sleep fails)."""
    made = strategy._new_transport

    def new_transport(g: Any, arrays: Any, ttl: float) -> GridTransport:
        transport = made(g, arrays, ttl)
        transport._clock, transport.sleep = grid.clock.now, grid.clock.sleep
        return transport

    monkeypatch.setattr(strategy, "_new_transport", new_transport)


def signed_federation(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    names: dict[int, str],
    *,
    listed: bool = True,
    delayed: bool = True,
    claimant_after: float = 0.5,
) -> tuple[LensembleStrategy, FakeGrid, dict[int, Context]]:
    """Four signing nodes, ``require-signatures``, quorum 3 and at most 3 attempts a
    round; node ``n`` claims ``names[n]``. ``listed``: under an allow-list of each
    node's own name and key (else each registers its key with its first commitment)."""
    config = small_config(min_participants=3, require_signatures=True, max_round_attempts=3)
    keys = {n: IdentityKey.generate() for n in NODES}
    grid, contexts = named_grid(config, keys, names, delayed=delayed, claimant_after=claimant_after)
    identities = {pid(OWN[n]): keys[n].public_openssh for n in NODES} if listed else None
    strategy = LensembleStrategy(
        config,
        run_dir=tmp_path / "run",
        run_id="names",
        fraction_evaluate=0.0,
        identities=identities,
        warmup_timeout=0.0,
    )
    on_the_fake_clock(strategy, grid, monkeypatch)
    return strategy, grid, contexts


HONEST = {pid(OWN[n]) for n in (12, 13, 14)}


def initial() -> ArrayRecord:
    return arrays_to_record(initial_params())


def test_a_node_cannot_take_an_honest_participants_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Node 11 is allow-listed as org-x but names itself org-b (node 12's name) and
    answers first, signing with its own key. Its claim binds nothing: org-b stays node
    12's, node 12 contributes every round, no round waits out its deadline and none is
    retried; node 11's messages are rejected as forged, and its answer ends its own wait.
    (When the first claim bound a name, node 11 took org-b, node 12 was refused, and the
    federation stopped after three attempts that each waited out the collect deadline.)"""
    names = {**OWN, CLAIMANT: OWN[HONEST_NODE]}
    strategy, grid, _ = signed_federation(tmp_path, monkeypatch, names)
    with caplog.at_level(logging.WARNING):
        result = strategy.start(grid=grid, initial_arrays=initial(), num_rounds=3)
    assert [(o.round, o.attempt, o.state) for o in result.outcomes] == [
        (r, 1, RoundState.CLOSED) for r in (1, 2, 3)
    ]
    assert all(o.refused == ("node-11",) and o.rejected == 2 for o in result.outcomes)
    ledger = verify(Store(tmp_path / "run"))
    assert [set(r.contributors) for r in ledger] == [HONEST] * 3
    # one exchange of 1 s per round (no open or collect deadline of 10 s waited out)
    assert grid.clock.t < 3 * 2.0
    assert strategy._names.name_of(HONEST_NODE) == pid(OWN[HONEST_NODE])
    assert strategy._names.name_of(CLAIMANT) == "node-11"  # bound to no name
    assert caplog.text.count("message rejected (ForgedMessage)") == 6  # 2 a round
    assert caplog.text.count("cannot sign for that name") == 1  # the claim: logged once


def test_in_flowers_own_loop_the_claim_binds_nothing_either(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same attack with Flower's own loop driving the strategy (configure_train,
    send_and_receive, aggregate_train): every round closes at its first attempt with
    the honest participants, node 12 among them."""
    names = {**OWN, CLAIMANT: OWN[HONEST_NODE]}
    strategy, grid, _ = signed_federation(tmp_path, monkeypatch, names, delayed=False)
    Strategy.start(strategy, grid=grid, initial_arrays=initial(), num_rounds=3)
    coordinator = strategy.coordinator
    assert coordinator is not None
    outcomes = list(coordinator.outcomes)
    assert [(o.round, o.attempt, o.state) for o in outcomes] == [
        (r, 1, RoundState.CLOSED) for r in (1, 2, 3)
    ]
    assert [set(r.contributors) for r in verify(Store(tmp_path / "run"))] == [HONEST] * 3


def test_the_claimant_still_takes_part_under_its_own_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed claim bans nobody: node 11 claims org-b in round 1 and does not get it;
    once it names itself by its own name (round 2 on), it contributes as org-x."""
    names = {**OWN, CLAIMANT: OWN[HONEST_NODE]}
    strategy, grid, contexts = signed_federation(tmp_path, monkeypatch, names)
    claiming = grid.nodes[CLAIMANT]

    def mends_its_ways(message: Message) -> Message | None:
        if message.metadata.group_id != "1":
            contexts[CLAIMANT].node_config["lensemble-id"] = OWN[CLAIMANT]
        return claiming(message)

    grid.nodes[CLAIMANT] = mends_its_ways
    result = strategy.start(grid=grid, initial_arrays=initial(), num_rounds=3)
    assert [(o.round, o.attempt, o.state) for o in result.outcomes] == [
        (r, 1, RoundState.CLOSED) for r in (1, 2, 3)
    ]
    everyone = HONEST | {pid(OWN[CLAIMANT])}
    ledger = verify(Store(tmp_path / "run"))
    assert [set(r.contributors) for r in ledger] == [HONEST, everyone, everyone]
    assert strategy._names.name_of(CLAIMANT) == pid(OWN[CLAIMANT])


@pytest.mark.parametrize("failure", ["raises", "junk", "unsigned"])
def test_the_claimants_failed_replies_are_its_own_never_the_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """After its claim to org-b failed, node 11's ClientApp raises, replies with junk, or
    sends its update in org-b's name unsigned. What the transport files for such a reply
    is node 11's refusal (under its own address, as the existing rule says: not taken
    until node 11 has signed for a name), never org-b's; an unsigned update in org-b's
    name is rejected as forged and ends node 11's wait. org-b contributes every round."""
    names = {**OWN, CLAIMANT: OWN[HONEST_NODE]}
    strategy, grid, contexts = signed_federation(tmp_path, monkeypatch, names)
    claiming = grid.nodes[CLAIMANT]
    config = strategy.config

    def failing(message: Message) -> Message | None:
        if message.metadata.group_id == "1":
            return claiming(message)
        if failure == "raises":
            error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="KeyError: 'lr'")
            return Message(error, reply_to=message)
        if failure == "junk":
            return Message(RecordDict({"config": ConfigRecord({"x": 1})}), reply_to=message)
        return clientapp_node(0, contexts[CLAIMANT], config)(message)  # no identity key

    grid.nodes[CLAIMANT] = failing
    result = strategy.start(grid=grid, initial_arrays=initial(), num_rounds=2)
    assert [(o.round, o.attempt, o.state) for o in result.outcomes] == [
        (1, 1, RoundState.CLOSED),
        (2, 1, RoundState.CLOSED),
    ]
    assert all(pid(OWN[HONEST_NODE]) not in o.refused for o in result.outcomes)
    ledger = verify(Store(tmp_path / "run"))
    assert [set(r.contributors) for r in ledger] == [HONEST] * 2
    assert strategy._names.name_of(CLAIMANT) == "node-11"
    second = result.outcomes[-1]
    if failure == "unsigned":  # answered, rejected: nobody waited for node 11
        assert second.refused == ("node-11",) and grid.clock.t < 2 * 2.0
    else:  # node 11's own refusal, not taken: it is waited for, as a silent node is
        assert second.refused == () and second.rejected == 1


@pytest.mark.parametrize("claimant_first", [False, True])
def test_without_an_allow_list_the_first_signed_claim_binds_the_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, claimant_first: bool
) -> None:
    """No allow-list (each key registered by its first commitment), signatures
    required, node 11 claiming org-b with its own key. Answering after node 12 bound
    org-b to its key, node 11 binds nothing and keeps nobody out. Answering first, it
    binds org-b to its own key, and node 12 is the one that cannot sign for it: trust on
    first use protects a name only once it is bound (docs/identity.md; an allow-list
    closes that gap)."""
    names = {**OWN, CLAIMANT: OWN[HONEST_NODE]}
    strategy, grid, _ = signed_federation(
        tmp_path, monkeypatch, names, listed=False, claimant_after=0.5 if claimant_first else 2.0
    )
    result = strategy.start(grid=grid, initial_arrays=initial(), num_rounds=2)
    assert [(o.round, o.attempt, o.state) for o in result.outcomes] == [
        (1, 1, RoundState.CLOSED),
        (2, 1, RoundState.CLOSED),
    ]
    squatted = "node-12" if claimant_first else "node-11"
    assert all(o.refused == (squatted,) for o in result.outcomes)
    assert grid.clock.t < 2 * 3.0  # nobody's deadline waited out
    assert [set(r.contributors) for r in verify(Store(tmp_path / "run"))] == [HONEST] * 2
    holder = CLAIMANT if claimant_first else HONEST_NODE
    assert strategy._names.name_of(holder) == pid(OWN[HONEST_NODE])


# -- the transport alone ---------------------------------------------------------------------
@pytest.mark.parametrize("proven", [True, False])
def test_a_transport_binds_a_claimed_name_only_when_the_claim_is_proven(
    proven: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Node 11 names itself partition-id-3. Proven (``proves_name`` says its first
    payload is signed for the name), the name is learnt; not proven, node 11 stays
    node-11, nobody is renamed, its payloads come as delivered from node-11 in the
    claimed name (for the coordinator to reject), and the claim is logged once."""
    clock = FakeClock()
    grid = FakeGrid(clock, {11: lensemble_node(11, sender="partition-id-3"), 12: silent})
    transport = make_transport(grid, clock)
    asked: list[str] = []
    transport.proves_name = lambda payload: asked.append(payload["kind"]) is None and proven
    renamed: list[tuple[str, str]] = []
    transport.on_rename = lambda old, new: renamed.append((old, new)) is None
    with caplog.at_level(logging.WARNING):
        for rnd in (1, 2):
            transport.send(transport.names.name_of(11), round_open(rnd))
            payloads = []
            while (payload := transport.recv(timeout_s=1.0)) is not None:
                payloads.append(payload)
            assert {p["sender"] for p in payloads} == {"partition-id-3"}
    assert asked == (["commitment"] if proven else ["commitment", "commitment"])
    assert transport.dropped == []
    if proven:
        assert renamed == [("node-11", "partition-id-3")]
        assert transport.names.name_of(11) == "partition-id-3"
        return
    assert renamed == [] and transport.names.name_of(11) == "node-11"
    delivered = [p for p in payloads if isinstance(p, DeliveredFrom)]
    assert len(delivered) == 2 and {(p.peer, p.node) for p in delivered} == {("node-11", 11)}
    assert caplog.text.count("cannot sign for that name") == 1


def test_an_unproven_claim_in_two_names_is_a_malformed_reply_of_its_node() -> None:
    """A reply whose claim is not proven and whose payloads name two senders: it cannot
    stand for the claimed name's messages; it is the node's own malformed reply."""
    clock = FakeClock()
    claims = lensemble_node(11, sender="partition-id-3")

    def two_names(message: Message) -> Message:
        reply = claims(message)
        update = reply.content.config_records[records.PREFIX + "update"]
        update["sender"] = update["participant_id"] = "partition-id-4"
        return reply

    grid = FakeGrid(clock, {11: two_names})
    transport = make_transport(grid, clock)
    transport.proves_name = lambda payload: False
    transport.send("node-11", round_open())
    (refusal,) = [from_wire(p) for p in drain(transport, timeout_s=1.0)]
    assert isinstance(refusal, Refusal)
    assert (refusal.error, refusal.participant_id) == ("MalformedReply", "node-11")
    assert transport.names.name_of(11) == "node-11"
