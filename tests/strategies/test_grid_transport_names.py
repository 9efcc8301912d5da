"""A Flower node's name is bound by a message signed for it: a node that claims another
participant's name, and cannot sign for it, binds nothing, answers for nobody else, and
keeps nobody out (fake Grid of ClientApps on a fake clock: no Ray, no real sleep)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from federation_helpers import small_config
from flwr.app import Context, Message, RecordDict
from flwr.serverapp.strategy import Strategy

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.identity.signing import IdentityKey
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.simulations.toy import initial_params
from lensemble_flwr.strategies import LensembleStrategy
from lensemble_flwr.strategies.grid_transport import GridTransport
from lensemble_flwr.strategies.records import arrays_to_record
from tests.strategies.test_grid_transport import (  # noqa: F401  (the autouse fixture sets the ServerApp identity)
    NODES,
    FakeClock,
    FakeGrid,
    _serverapp_identity,
    clientapp_node,
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
) -> tuple[FakeGrid, dict[int, Context]]:
    """A fake Grid of lensemble ClientApps: node ``n`` names itself ``names[n]`` (its
    node config's ``lensemble-id``) and signs with ``keys[n]``; the claimant answers
    first (after 0.5 s, every other node after 1 s; ``delayed=False``: all at once, in
    node order, the claimant first, as Flower's own loop needs them)."""
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
        return 0.5 if node == CLAIMANT else 1.0

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
) -> tuple[LensembleStrategy, FakeGrid, dict[int, Context]]:
    """Four signing nodes, ``require-signatures``, quorum 3 and at most 3 attempts a
    round; node ``n`` claims ``names[n]``. ``listed``: under an allow-list of each
    node's own name and key (else each registers its key with its first commitment)."""
    config = small_config(min_participants=3, require_signatures=True, max_round_attempts=3)
    keys = {n: IdentityKey.generate() for n in NODES}
    grid, contexts = named_grid(config, keys, names, delayed=delayed)
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
INITIAL = arrays_to_record(initial_params())


def test_a_node_cannot_take_an_honest_participants_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Node 11 is allow-listed as org-x but names itself org-b (node 12's name) and
    answers first, signing with its own key. Its claim binds nothing: org-b stays node
    12's, node 12 contributes every round, no round waits out its deadline and none is
    retried; node 11's messages are rejected as forged, and its answer ends its own wait
    (on main, node 11 took the name, node 12 was refused, and the federation stopped
    after three attempts that each waited out the collect deadline)."""
    names = {**OWN, CLAIMANT: OWN[HONEST_NODE]}
    strategy, grid, _ = signed_federation(tmp_path, monkeypatch, names)
    with caplog.at_level(logging.WARNING):
        result = strategy.start(grid=grid, initial_arrays=INITIAL, num_rounds=3)
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
    Strategy.start(strategy, grid=grid, initial_arrays=INITIAL, num_rounds=3)
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
    result = strategy.start(grid=grid, initial_arrays=INITIAL, num_rounds=3)
    assert [(o.round, o.attempt, o.state) for o in result.outcomes] == [
        (r, 1, RoundState.CLOSED) for r in (1, 2, 3)
    ]
    everyone = HONEST | {pid(OWN[CLAIMANT])}
    ledger = verify(Store(tmp_path / "run"))
    assert [set(r.contributors) for r in ledger] == [HONEST, everyone, everyone]
    assert strategy._names.name_of(CLAIMANT) == pid(OWN[CLAIMANT])
