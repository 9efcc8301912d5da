"""flower_app.py: the example ServerApps check their run config before anything else."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
from flwr.app import Context, Message, RecordDict

from lensemble_flwr.errors import ConfigError
from lensemble_flwr.simulations import digits, flower_app, world
from tests.strategies.test_grid_transport import (  # noqa: F401  (the autouse fixture sets the ServerApp identity)
    FakeClock,
    FakeGrid,
    _serverapp_identity,
    silent,
)


class RecordingGrid(FakeGrid):
    """A FakeGrid that records every Grid call made of it, by name."""

    def __init__(self) -> None:
        super().__init__(FakeClock(), {11: silent, 12: silent})
        self.calls: list[str] = []

    def get_node_ids(self) -> list[int]:
        self.calls.append("get_node_ids")
        return super().get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        self.calls.append("push_messages")
        return super().push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        self.calls.append("pull_messages")
        return super().pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        self.calls.append("send_and_receive")
        return super().send_and_receive(messages, timeout=timeout)

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        self.calls.append("create_message")
        return super().create_message(*args, **kwargs)


def server_context(run_config: dict[str, Any]) -> Context:
    return Context(run_id=3, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)


def app_grid(
    client_app: Callable[[Message, Context], Message],
    run_config: dict[str, Any],
    nodes: Sequence[int],
    node_config: dict[str, Any] | None = None,
) -> tuple[FakeGrid, dict[int, Context]]:
    """A fake Grid whose nodes run ``client_app``, node i as ``partition-id`` i of
    ``len(nodes)`` (with ``node_config`` over that), and the nodes' contexts."""
    contexts = {
        n: Context(
            run_id=1,
            node_id=n,
            node_config={"partition-id": i, "num-partitions": len(nodes), **(node_config or {})},
            state=RecordDict(),
            run_config=run_config,
        )
        for i, n in enumerate(nodes)
    }

    def node(context: Context) -> Callable[[Message], Message]:
        return lambda message: client_app(message, context)

    return FakeGrid(FakeClock(), {n: node(contexts[n]) for n in nodes}), contexts


def run_server_app(
    main: Callable[[Any, Context], None],
    grid: FakeGrid,
    run_config: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> Any:
    """Run a ServerApp's ``main`` over ``grid``; the result its strategy's ``start``
    returned."""
    from lensemble_flwr.strategies import LensembleStrategy

    results: list[Any] = []
    start = LensembleStrategy.start

    def keep_result(self: LensembleStrategy, *args: Any, **kwargs: Any) -> Any:
        results.append(start(self, *args, **kwargs))
        return results[-1]

    monkeypatch.setattr(LensembleStrategy, "start", keep_result)
    server = Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    main(grid, server)
    (result,) = results
    return result


def forbid_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any connection the code under test opens fails the test: nothing is downloaded."""

    def no_network(self: socket.socket, *args: Any) -> None:
        raise AssertionError(f"the app opened a connection to {args}: nothing is downloaded")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", no_network)


def test_the_digits_serverapp_refuses_a_bad_value_before_any_grid_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    grid = RecordingGrid()
    context = server_context({"num-server-rounds": 2, "lensemble.collect-timeout": -5})
    with caplog.at_level("ERROR", logger="flwr"), pytest.raises(ConfigError) as raised:
        digits.main(grid, context)
    assert raised.value.field == "lensemble.collect-timeout"
    assert grid.calls == []
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert line == (
        "the run config is refused, nothing was started: lensemble.collect-timeout: "
        "Input should be greater than 0 (got -5)"
    )


def test_the_world_serverapp_checks_before_building_its_gauge_or_asking_the_grid(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The world app's own check (its action heads stay local) runs with lensemble's,
    first: before the gauge is built or the Grid is asked anything; the key is named as
    the run config writes it."""
    built: list[int] = []
    monkeypatch.setattr(world, "world_gauge", lambda seed: built.append(seed))
    grid = RecordingGrid()
    context = server_context({"lensemble.shared-groups": "*", "lensemble.local-groups": ""})
    with caplog.at_level("ERROR", logger="flwr"), pytest.raises(ConfigError) as raised:
        world.main(grid, context)
    assert raised.value.field == "lensemble.local-groups"
    assert (grid.calls, built) == ([], [])
    assert "nothing was started: lensemble.local-groups: the world model keeps" in caplog.text
    grid = RecordingGrid()
    with pytest.raises(ConfigError, match=r"^lensemble\.outer_lr: unknown .*'lensemble\.outer-lr'"):
        world.main(grid, server_context({"lensemble.outer_lr": 0.5}))
    assert (grid.calls, built) == ([], [])


def test_the_apps_own_noise_multiplier_does_not_stop_the_serverapp() -> None:
    """Flower's fl-dp-sa declares noise-multiplier for its DP wrapper: the app's key is
    not lensemble's, and lensemble.noise-multiplier alone sets lensemble's noise."""
    context = server_context({"noise-multiplier": 0.5, "lensemble.noise-multiplier": 0})
    config = flower_app.checked_config(context)
    assert config.privacy.noise_multiplier == 0
    config, strategy = flower_app.strategy_from_context(context, config)
    assert strategy.config is config


def test_the_digits_client_app_trains_the_model_its_run_config_names() -> None:
    from lensemble_flwr.simulations.digits_data import DigitsLinear, DigitsNet

    def context(run_config: dict[str, Any]) -> Context:
        return Context(
            run_id=1, node_id=3, node_config={"partition-id": 2, "num-partitions": 10},
            state=RecordDict(), run_config=run_config,
        )  # fmt: skip

    assert isinstance(digits.trainer_fn(context({})).trainer.model, DigitsNet)
    assert isinstance(digits.trainer_fn(context({"model": "linear"})).trainer.model, DigitsLinear)
    with pytest.raises(ConfigError, match="model: 'mlp' is not a digits model"):
        digits.trainer_fn(context({"model": "mlp"}))


def test_per_node_metrics_average_each_node_once_and_count_who_beats_local() -> None:
    from flwr.app import MetricRecord, RecordDict

    from lensemble_flwr.simulations.flower_app import PerNodeMetrics

    def reply(node: int, glob: float, local: float) -> RecordDict:
        return RecordDict({"metrics": MetricRecord({"node": node, "g": glob, "l": local})})

    aggregate = PerNodeMetrics(("g", "l"), "g", "l")
    out = aggregate(
        [
            reply(0, 1.0, 2.0),
            reply(1, 5.0, 1.0),  # the same node again: its last reply counts
            reply(1, 3.0, 2.0),
            reply(2, float("nan"), 4.0),
        ],
        "num-examples",
    )
    assert out["g"] == 2.0 and out["l"] == (2.0 + 2.0 + 4.0) / 3  # node 1 once, NaN left out
    beating = out["nodes-beating-local"]
    assert beating == 1 and isinstance(beating, int)  # node 0 only (NaN < 4 is false); a count
    assert sorted(aggregate.by_node) == [0, 1, 2]


def test_per_node_metrics_count_a_higher_accuracy_as_beating_local_when_told() -> None:
    from flwr.app import MetricRecord, RecordDict

    from lensemble_flwr.simulations.flower_app import PerNodeMetrics

    def reply(node: int, glob: float, local: float) -> RecordDict:
        return RecordDict({"metrics": MetricRecord({"node": node, "g": glob, "l": local})})

    replies = [reply(0, 0.9, 0.8), reply(1, 0.7, 0.8), reply(2, 0.8, 0.8), reply(3, 0.9, 0.5)]
    higher = PerNodeMetrics(("g", "l"), "g", "l", higher_is_better=True)(replies, "num-examples")
    assert higher["nodes-beating-local"] == 2  # nodes 0 and 3; the tie (node 2) does not count
    lower = PerNodeMetrics(("g", "l"), "g", "l")(replies, "num-examples")
    assert lower["nodes-beating-local"] == 1  # as a loss: node 1 only
