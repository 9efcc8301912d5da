"""warm_up.py: waiting for the nodes before round 1, sending them nothing."""

from __future__ import annotations

import pytest

from lensemble_flwr.config import FederationConfig
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.strategies.warm_up import WARM_UP_SETTLE_S, wait_for_nodes, warm_up
from tests.strategies.test_grid_transport import (  # noqa: F401  (the autouse fixture sets the ServerApp identity)
    FakeClock,
    FakeGrid,
    _serverapp_identity,
    make_transport,
    silent,
)


def test_warm_up_waits_for_min_nodes_and_sends_them_nothing() -> None:
    clock = FakeClock()
    grid = FakeGrid(clock, {11: silent, 12: silent, 13: silent, 14: silent},
                    appear_at={13: 2.5, 14: 2.5})  # fmt: skip
    # a node list is normally reused for peer_refresh seconds: warm-up must look again
    transport = make_transport(grid, clock, message_ttl=2.0, peer_refresh=60.0)
    connected = wait_for_nodes(transport, min_nodes=3, timeout_s=10.0)
    assert connected == ["node-11", "node-12", "node-13", "node-14"]
    assert grid.pushes == []  # a stock ClientApp has no query handler: nothing is sent
    assert 2.5 <= clock.t <= 10.0


def test_warm_up_gives_up_at_its_timeout() -> None:
    clock = FakeClock()
    grid = FakeGrid(clock, {11: silent}, appear_at={11: 100.0})
    transport = make_transport(grid, clock)
    assert wait_for_nodes(transport, min_nodes=1, timeout_s=3.0) == []
    assert clock.t == pytest.approx(3.0)


def test_warm_up_on_the_simulation_engine_does_not_wait_for_nodes_that_cannot_come(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the simulation engine the nodes are registered as it starts (``declared_size``):
    a count too low that stays so for a few seconds is said then, not after the warm-up
    timeout; a count still rising (or none yet) is waited for as before."""
    clock = FakeClock()
    grid = FakeGrid(clock, {11: silent, 12: silent, 13: silent}, appear_at={13: 2.5})
    transport = make_transport(grid, clock)
    monkeypatch.setattr(transport, "declared_size", lambda: len(grid.get_node_ids()))
    nodes = ["node-11", "node-12", "node-13"]
    assert wait_for_nodes(transport, min_nodes=4, timeout_s=120.0) == nodes
    assert 2.5 + WARM_UP_SETTLE_S <= clock.t <= 2.5 + WARM_UP_SETTLE_S + 1.0  # then settled
    assert wait_for_nodes(transport, min_nodes=3, timeout_s=120.0) == nodes
    clock = FakeClock()
    grid = FakeGrid(clock, {11: silent}, appear_at={11: 30.0})  # the engine not started yet
    transport = make_transport(grid, clock)
    monkeypatch.setattr(transport, "declared_size", lambda: len(grid.get_node_ids()))
    assert wait_for_nodes(transport, min_nodes=1, timeout_s=120.0) == ["node-11"]
    assert 30.0 <= clock.t <= 31.0


@pytest.mark.parametrize(
    ("min_participants", "secagg_threshold", "field", "says", "lower"),
    [
        (2, 3, "secagg-threshold", "K = 3 is set by lensemble.secagg-threshold "
         "(min-participants is 2)", "lower lensemble.secagg-threshold to at most 2"),
        (3, 0, "min-participants", "K = 3 is set by lensemble.min-participants "
         "(secagg-threshold is 0)", "lower lensemble.min-participants to at most 2"),
        (3, 3, "secagg-threshold", "K = 3 is set by both lensemble.min-participants and "
         "lensemble.secagg-threshold", "lower lensemble.min-participants and "
         "lensemble.secagg-threshold to at most 2"),
    ],
)  # fmt: skip
def test_too_few_nodes_for_k_names_what_sets_k(
    monkeypatch: pytest.MonkeyPatch,
    min_participants: int,
    secagg_threshold: int,
    field: str,
    says: str,
    lower: str,
) -> None:
    """secagg-threshold=3 min-participants=2 on 2 nodes: lowering min-participants cannot
    help, so the error names secagg-threshold as what sets K (and both when they tie)."""
    clock = FakeClock()
    grid = FakeGrid(clock, {11: silent, 12: silent})
    transport = make_transport(grid, clock)
    monkeypatch.setattr(transport, "declared_size", lambda: 2)  # the simulation engine's
    fed = FederationConfig(min_participants=min_participants, secagg_threshold=secagg_threshold)
    with pytest.raises(ConfigError) as raised:
        warm_up(transport, fed, 30.0, done=0, num_rounds=3, run_dir=None)
    assert raised.value.field == field
    text = str(raised.value)
    said = "the simulation engine runs 2 node(s), and every round needs K = 3"
    assert text.startswith(f"{field}: {said}")
    assert says in text and text.endswith(lower)
    assert grid.pushes == []
