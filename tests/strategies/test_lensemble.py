"""LensembleStrategy's Flower surface without Ray: Flower's stock loop, config refusals."""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from federation_helpers import dp_config, small_config
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
from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_ins_message
from flwr.serverapp.strategy import Strategy

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.errors import ConfigError, FaultToleranceExceeded, StoreError
from lensemble_flwr.protocol.messages import RoundOpen
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.round_metrics import read_round_metrics
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.simulations import digits
from lensemble_flwr.simulations.toy import initial_params
from lensemble_flwr.strategies import LensembleStrategy
from lensemble_flwr.strategies.grid_transport import GridTransport
from lensemble_flwr.strategies.lensemble import LensembleResult
from lensemble_flwr.strategies.records import arrays_to_record, record_to_arrays
from tests.strategies.test_grid_transport import (  # noqa: F401  (the autouse fixture sets the ServerApp identity)
    NODES,
    FakeClock,
    FakeGrid,
    _serverapp_identity,
    clientapp_node,
)


def clientapp_grid(config: Any, grid_class: type[FakeGrid] = FakeGrid) -> FakeGrid:
    """A fake Grid of lensemble ClientApps, one per node of NODES, each with its own Context."""
    contexts = {
        n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
        for n in NODES
    }
    return grid_class(
        FakeClock(), {n: clientapp_node(i, contexts[n], config) for i, n in enumerate(NODES)}
    )


def stock_loop_federation(
    tmp_path: Path, config: Any = None, **arguments: Any
) -> tuple[LensembleStrategy, FakeGrid]:
    config = config or small_config(min_participants=3)
    grid = clientapp_grid(config)
    arguments = {"run_id": "stock-loop", "fraction_evaluate": 0.0, **arguments}
    strategy = LensembleStrategy(config, run_dir=tmp_path / "run", **arguments)
    return strategy, grid


def test_flowers_stock_loop_drives_the_same_state_machine(tmp_path: Path) -> None:
    """Strategy.start (Flower's own loop) → configure_train, send_and_receive,
    aggregate_train: each aggregate_train is one round attempt of the coordinator."""
    strategy, grid = stock_loop_federation(tmp_path)
    result = Strategy.start(
        strategy,
        grid=grid,
        initial_arrays=arrays_to_record(initial_params()),
        num_rounds=3,
        train_config=ConfigRecord({"lr": 0.1}),
    )
    coordinator = strategy.coordinator
    assert coordinator is not None and coordinator.global_state().round == 3
    final = record_to_arrays(result.arrays)
    for name, array in coordinator.global_state().params.items():
        np.testing.assert_array_equal(final[name], array)
    counts = [result.train_metrics_clientapp[r]["lensemble.C_t"] for r in (1, 2, 3)]
    assert counts == [4.0, 4.0, 4.0]
    records = verify(Store(tmp_path / "run"))
    assert [r.count for r in records] == [4, 4, 4]
    # the user's train config rides along for stock ClientApps
    first = grid.pushes[0][0]
    assert first.content["config"]["lr"] == 0.1


class _DecayingLearningRate(LensembleStrategy):
    """What Flower's advanced examples do to FedAvg: a per-round config in
    ``configure_train`` and a look at every aggregated model in ``aggregate_train``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.aggregated: list[int] = []

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Any
    ) -> Any:
        config["lr"] = 0.1 * 0.5**server_round
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Any) -> Any:
        arrays, metrics = super().aggregate_train(server_round, replies)
        self.aggregated.append(server_round)
        return arrays, metrics


def test_a_subclass_overriding_flowers_round_hooks_has_them_called_every_round(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """start's one loop calls the strategy's own configure_train and aggregate_train
    every round, as Flower's loop does: a subclass's overrides run, and lensemble's
    deadlines and exchange counts come with them."""
    _, grid = stock_loop_federation(tmp_path)
    lines: list[str] = []
    strategy = _DecayingLearningRate(
        small_config(min_participants=3),
        run_dir=tmp_path / "run",
        fraction_evaluate=0.0,
        on_round=lines.append,
    )
    with caplog.at_level(logging.INFO, logger="flwr"):
        result = strategy.start(
            grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=3
        )
    assert strategy.aggregated == [1, 2, 3]
    rates = [m.content["config"]["lr"] for m in grid.pushed() if "config" in m.content]
    assert rates == [0.05] * len(NODES) + [0.025] * len(NODES) + [0.0125] * len(NODES)
    assert "overrides" not in caplog.text and "Strategy.start" not in caplog.text
    assert [line.split(":")[0] for line in lines] == ["round 1", "round 2", "round 3"]
    assert all("exchanges=1" in line for line in lines)  # start moves the messages
    assert result.train_metrics_clientapp[3]["lensemble.exchanges"] == 1.0
    coordinator = strategy.coordinator
    assert coordinator is not None and coordinator.global_state().round == 3
    assert isinstance(result, LensembleResult) and result.run_dir == tmp_path / "run"
    assert [(o.round, o.attempt) for o in result.outcomes] == [(1, 1), (2, 1), (3, 1)]
    final = record_to_arrays(result.arrays)
    for name, array in coordinator.global_state().params.items():
        np.testing.assert_array_equal(final[name], array)
    assert [r.round for r in verify(Store(tmp_path / "run"))] == [1, 2, 3]


def _evaluating_node(index: int, context: Context, train: Any) -> Any:
    """A node that trains as ``train`` does and answers an evaluation with an accuracy."""

    def answer(message: Message) -> Message:
        if message.metadata.message_type == MessageType.EVALUATE:
            metrics = MetricRecord({"accuracy": 0.5 + 0.1 * index, "num-examples": 1})
            return Message(RecordDict({"metrics": metrics}), reply_to=message)
        return train(message)

    return answer


def _evaluating_federation(config: Any) -> FakeGrid:
    contexts = {
        n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
        for n in NODES
    }
    return FakeGrid(
        FakeClock(),
        {
            n: _evaluating_node(i, contexts[n], clientapp_node(i, contexts[n], config))
            for i, n in enumerate(NODES)
        },
    )


def test_a_subclass_in_start_reports_each_round_once_with_its_evaluation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """In start, a subclass's round gets one report line (and on_round) once it is
    evaluated, with the evaluation's metrics, and one line in round-metrics.jsonl."""
    config = small_config(min_participants=3)
    grid = _evaluating_federation(config)
    lines: list[str] = []
    strategy = _DecayingLearningRate(config, run_dir=tmp_path / "run", on_round=lines.append)
    with caplog.at_level(logging.INFO, logger="flwr"):
        result = strategy.start(
            grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2
        )
    mean = (0.5 + 0.6 + 0.7 + 0.8) / 4
    assert [line.split(":")[0] for line in lines] == ["round 1", "round 2"]
    assert all("C_t=4" in line and f"accuracy={mean:.4f}" in line for line in lines)
    assert lines[0] in caplog.text
    # FedAvg's lines for the replies, each round
    for kind in ("aggregate_train", "aggregate_evaluate"):
        assert caplog.text.count(f"{kind}: Received 4 results and 0 failures") == 2, kind
    jsonl = (tmp_path / "run" / "round-metrics.jsonl").read_text()
    written = [json.loads(line) for line in jsonl.splitlines()]
    assert [w["round"] for w in written] == [1, 2]
    for line in written:
        assert line["evaluate"]["accuracy"] == pytest.approx(mean)
        counts = ("C_t", "attempts", "aborted-attempts", "late", "rejected", "refused")
        assert [line["train"][f"lensemble.{c}"] for c in counts] == [4, 1, 0, 0, 0, 0]
    for metrics in result.train_metrics_clientapp.values():  # counts are integers
        assert all(isinstance(metrics[f"lensemble.{c}"], int) for c in counts)
    assert result.evaluate_metrics_clientapp[2]["accuracy"] == pytest.approx(mean)


def test_flowers_own_loop_reports_every_attempt_and_writes_the_rounds_metrics(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """In Flower's own loop (Strategy.start) each attempt gets start's report line and
    on_round (from aggregate_train), and each committed round its line in
    round-metrics.jsonl, again with the evaluation's metrics (from aggregate_evaluate),
    for lensemble-flwr report's curves."""
    config = small_config(min_participants=3)
    contexts = {
        n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
        for n in NODES
    }
    grid = FakeGrid(
        FakeClock(),
        {
            n: _evaluating_node(i, contexts[n], clientapp_node(i, contexts[n], config))
            for i, n in enumerate(NODES)
        },
    )
    lines: list[str] = []
    strategy = _DecayingLearningRate(config, run_dir=tmp_path / "run", on_round=lines.append)
    with caplog.at_level(logging.INFO, logger="flwr"):
        result = Strategy.start(
            strategy, grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2
        )
    assert [line.split(":")[0] for line in lines] == ["round 1", "round 2"]
    assert all("C_t=4" in line for line in lines) and lines[0] in caplog.text
    assert strategy.aggregated == [1, 2]
    jsonl = (tmp_path / "run" / "round-metrics.jsonl").read_text()
    written = [json.loads(line) for line in jsonl.splitlines()]
    assert [w["round"] for w in written] == [1, 1, 2, 2]  # train first, then with evaluation
    mean = (0.5 + 0.6 + 0.7 + 0.8) / 4
    for line in written[1::2]:
        assert line["evaluate"]["accuracy"] == pytest.approx(mean)
        assert line["train"]["lensemble.C_t"] == 4.0
    assert result.evaluate_metrics_clientapp[2]["accuracy"] == pytest.approx(mean)


def test_a_subclass_overriding_flowers_round_hooks_resumes_its_run(tmp_path: Path) -> None:
    """One loop for every strategy: a subclass resumes as LensembleStrategy does (its
    hooks called for the rounds left), where Flower's own loop restarts at round 1."""
    _, grid = stock_loop_federation(tmp_path)
    initial = arrays_to_record(initial_params())
    first = _DecayingLearningRate(
        small_config(min_participants=3), run_dir=tmp_path / "run", run_id="sub"
    )
    first.start(grid=grid, initial_arrays=initial, num_rounds=2)
    before = [r.record_hash for r in verify(Store(tmp_path / "run"))]
    again = _DecayingLearningRate(
        small_config(min_participants=3), run_dir=tmp_path / "run", run_id="sub", resume=True
    )
    result = again.start(grid=grid, initial_arrays=initial, num_rounds=3)
    assert again.aggregated == [3] and list(result.train_metrics_clientapp) == [3]
    records = verify(Store(tmp_path / "run"))
    assert [r.record_hash for r in records[:2]] == before
    assert [r.round for r in records] == [1, 2, 3] and records[2].external_step is None


class _SendsNothing(LensembleStrategy):
    """Begins each attempt and sends none of its instructions."""

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Any
    ) -> Any:
        super().configure_train(server_round, arrays, config, grid)
        return []


class _FirstAttemptSendsNothing(LensembleStrategy):
    """The run's first attempt sends none of its instructions (so it aborts); every
    later attempt goes out as usual."""

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Any
    ) -> Any:
        messages = super().configure_train(server_round, arrays, config, grid)
        first = not getattr(self, "sent_once", False)
        self.sent_once = True
        return [] if first else messages


def test_a_retried_round_in_start_is_the_same_round_and_counts_its_attempts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A retry is the same round (configure_train is asked for server_round 1 again),
    and the round's one line and metrics count both attempts. The nodes whose
    instructions configure_train left out refuse the attempt at once: it ends without
    waiting for its deadlines."""
    _, grid = stock_loop_federation(tmp_path)
    lines: list[str] = []
    strategy = _FirstAttemptSendsNothing(
        small_config(min_participants=3),
        run_dir=tmp_path / "run",
        fraction_evaluate=0.0,
        on_round=lines.append,
    )
    with caplog.at_level(logging.INFO):
        result = strategy.start(
            grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2
        )
    assert [(o.round, o.attempt) for o in result.outcomes] == [(1, 1), (1, 2), (2, 1)]
    first = result.outcomes[0]
    assert first.refused == tuple(sorted(f"node-{n}" for n in NODES))
    assert first.elapsed < 5.0  # open timeout 10 s: not waited for
    assert "never sent: configure_train left this node's instruction out" in caplog.text
    assert [line.split(":")[0] for line in lines] == ["round 1", "round 2"]
    assert "aborted=1" in lines[0] and "aborted" not in lines[1]
    jsonl = (tmp_path / "run" / "round-metrics.jsonl").read_text()
    (one, two) = [json.loads(line)["train"] for line in jsonl.splitlines()]
    assert one["lensemble.attempts"] == 2.0 and one["lensemble.aborted-attempts"] == 1.0
    assert two["lensemble.attempts"] == 1.0
    assert result.train_metrics_clientapp[1]["lensemble.attempts"] == 2.0
    assert list(result.aborted) == [1]


class _HalvesItsLearningRateAtRound1(_FirstAttemptSendsNothing):
    """Flower's advanced-pytorch schedule: ``config["lr"]`` halved in place at a round."""

    seen: list[tuple[int, float]]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Any
    ) -> Any:
        if server_round == 1:
            config["lr"] = config["lr"] * 0.5
        self.seen = [*getattr(self, "seen", []), (server_round, config["lr"])]
        return super().configure_train(server_round, arrays, config, grid)


def test_a_retried_round_hands_configure_train_the_config_as_the_round_began(
    tmp_path: Path,
) -> None:
    """An override that changes the train config in place changes it once per round, as
    in Flower's loop: a retry starts from the config as the round's first attempt found
    it, and what the closing attempt changed carries on to the next round."""
    _, grid = stock_loop_federation(tmp_path)
    strategy = _HalvesItsLearningRateAtRound1(
        small_config(min_participants=3), run_dir=tmp_path / "run", fraction_evaluate=0.0
    )
    result = strategy.start(
        grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2,
        train_config=ConfigRecord({"lr": 0.1}),
    )  # fmt: skip
    assert [(o.round, o.attempt) for o in result.outcomes] == [(1, 1), (1, 2), (2, 1)]
    assert strategy.seen == [(1, 0.05), (1, 0.05), (2, 0.05)]


def test_flowers_own_loop_counts_a_retried_rounds_attempts_as_start_does(
    tmp_path: Path,
) -> None:
    """In Flower's own loop a retried attempt takes a Flower round: each attempt's line
    names the round's aborted attempts so far; the committed round's metrics count both
    attempts; no exchange count is made up (Flower's loop counts none)."""
    _, grid = stock_loop_federation(tmp_path)
    lines: list[str] = []
    strategy = _FirstAttemptSendsNothing(
        small_config(min_participants=3),
        run_dir=tmp_path / "run",
        fraction_evaluate=0.0,
        on_round=lines.append,
    )
    result = Strategy.start(
        strategy, grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=3
    )
    assert [line.split(":")[0] for line in lines] == ["round 1", "round 1", "round 2"]
    assert "aborted=1" in lines[0] and "aborted=1" in lines[1] and "aborted" not in lines[2]
    assert not any("exchanges=" in line or "sent=" in line for line in lines)
    jsonl = (tmp_path / "run" / "round-metrics.jsonl").read_text()
    (first, second) = [json.loads(line)["train"] for line in jsonl.splitlines()]
    assert first["lensemble.attempts"] == 2.0 and first["lensemble.aborted-attempts"] == 1.0
    assert second["lensemble.attempts"] == 1.0
    assert result.train_metrics_clientapp[2]["lensemble.attempts"] == 2.0  # Flower round 2


def test_flowers_loop_takes_back_its_run_when_the_initial_evaluation_raises(
    tmp_path: Path,
) -> None:
    """Flower's loop evaluates the initial model before round 1; an evaluate_fn that
    raises there leaves no run behind, so the same start runs once it is fixed."""
    _, grid = stock_loop_federation(tmp_path)

    def broken(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        raise RuntimeError("the test set is missing")

    calls: list[int] = []

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        calls.append(server_round)
        return MetricRecord({"loss": 1.0})

    initial = arrays_to_record(initial_params())
    failing = _DecayingLearningRate(
        small_config(min_participants=3), run_dir=tmp_path / "run", fraction_evaluate=0.0
    )
    with pytest.raises(RuntimeError, match="the test set is missing"):
        failing.start(grid=grid, initial_arrays=initial, num_rounds=1, evaluate_fn=broken)
    assert grid.pushed() == [] and not (tmp_path / "run").exists()
    fixed = _DecayingLearningRate(
        small_config(min_participants=3), run_dir=tmp_path / "run", fraction_evaluate=0.0
    )
    result = fixed.start(grid=grid, initial_arrays=initial, num_rounds=1, evaluate_fn=evaluate)
    assert calls == [0, 1]  # the initial evaluation once, then round 1's
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1]


def test_a_subclass_that_sends_nothing_stops_the_run_once_the_attempts_are_used_up(
    tmp_path: Path,
) -> None:
    """Every attempt of round 1 is refused by every node (never sent): the round uses up
    max-round-attempts, and the federation stops with the round's error, as for any
    strategy; nothing is committed."""
    _, grid = stock_loop_federation(tmp_path)
    config = small_config(min_participants=3, max_round_attempts=2)
    strategy = _SendsNothing(config, run_dir=tmp_path / "run", fraction_evaluate=0.0)
    with pytest.raises(FaultToleranceExceeded, match="quorum 3"):
        strategy.start(grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2)
    assert grid.pushed() == [] and verify(Store(tmp_path / "run")) == []


class _HalvesTheModel(LensembleStrategy):
    """Changes every model it aggregates (as a server-side step of one's own would)."""

    def aggregate_train(self, server_round: int, replies: Any) -> Any:
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is not None:
            arrays = ArrayRecord({n: Array(a.numpy() * 0.5) for n, a in arrays.items()})
        return arrays, metrics


def test_a_change_in_the_last_rounds_model_is_said_to_be_outside_the_ledger(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, grid = stock_loop_federation(tmp_path)
    strategy = _HalvesTheModel(small_config(min_participants=3), run_dir=tmp_path / "run")
    with caplog.at_level(logging.WARNING):
        result = strategy.start(
            grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2
        )
    coordinator = strategy.coordinator
    assert coordinator is not None and coordinator.global_state().round == 2
    committed = coordinator.global_state().params
    for name, array in record_to_arrays(result.arrays).items():  # Flower's: what it returned
        np.testing.assert_array_equal(array, committed[name] * np.float32(0.5))
    assert "differs from round 2's committed checkpoint" in caplog.text
    records = verify(Store(tmp_path / "run"))
    assert records[1].external_step is not None  # round 2 trained from round 1's change


def test_flowers_loop_checks_what_starts_own_loop_checks_before_anything(
    tmp_path: Path,
) -> None:
    evaluated: list[int] = []

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> None:
        evaluated.append(server_round)

    _, grid = stock_loop_federation(tmp_path)
    initial = arrays_to_record(initial_params())
    too_few = _DecayingLearningRate(
        small_config(min_participants=6), run_dir=tmp_path / "few", warmup_timeout=0.0
    )
    with pytest.raises(ConfigError, match="every round needs K = 6"):
        too_few.start(grid=grid, initial_arrays=initial, evaluate_fn=evaluate_fn)
    assert evaluated == [] and grid.pushed() == []
    assert not (tmp_path / "few").exists()  # the run it began is taken back


def test_a_subclass_runs_masked_rounds_with_its_hooks_called(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The unmask exchange happens within the attempt, in the default aggregate_train:
    a subclass's hooks run every masked round, as in plaintext ones. FedAvg's line counts
    each node once, whatever the exchanges."""
    config = small_config(min_participants=3, secagg_threshold=3)
    grid = clientapp_grid(config)
    strategy = _DecayingLearningRate(config, run_dir=tmp_path / "masked", run_id="masked")
    with caplog.at_level(logging.INFO, logger="flwr"):
        result = strategy.start(
            grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2
        )
    said = [r.getMessage() for r in caplog.records]
    received = [m for m in said if "aggregate_train: Received" in m]
    assert received == ["aggregate_train: Received 4 results and 0 failures"] * 2
    assert strategy.aggregated == [1, 2]
    records = verify(Store(tmp_path / "masked"))
    assert [r.count for r in records] == [4, 4]
    rates = {m.content["config"].get("lr") for m in grid.pushed() if "config" in m.content}
    assert {0.05, 0.025} <= rates
    assert result.train_metrics_clientapp[2]["lensemble.exchanges"] == 2.0  # train, unmask


def test_flowers_loop_refuses_a_dp_plan_that_does_not_fit_before_anything(
    tmp_path: Path,
) -> None:
    _, grid = stock_loop_federation(tmp_path)
    config = dp_config(tmp_path, noise_multiplier=0.0, dp_epsilon=40.0, dp_rounds=1)
    strategy = _DecayingLearningRate(config, run_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match="plans 2 rounds but the noise is planned for dp-rou"):
        strategy.start(grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2)
    assert grid.pushed() == [] and strategy.coordinator is None


class _TimedGrid(FakeGrid):
    """Records the timeout of every send_and_receive (Flower's loop passes its own)."""

    timeouts: list[float | None]

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> Any:
        self.timeouts.append(timeout)
        return super().send_and_receive(messages, timeout=timeout)


def test_a_subclass_in_start_keeps_lensembles_deadlines_and_the_first_rounds_grace(
    tmp_path: Path,
) -> None:
    config = small_config(min_participants=3)  # open 10 s + collect 10 s
    grid = clientapp_grid(config, _TimedGrid)
    grid.timeouts = []
    strategy = _DecayingLearningRate(
        config, run_dir=tmp_path / "run", fraction_evaluate=0.0, warmup_timeout=5.0
    )
    strategy.start(grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2)
    # no Flower send_and_receive with its one timeout: each instruction lives as long as
    # its round's deadlines, round 1's with what the warm-up left (5 s) as grace
    assert grid.timeouts == []
    ttls = [(int(m.metadata.group_id), m.metadata.ttl) for m in grid.pushed()]
    assert ttls == [(1, pytest.approx(25.0, abs=1.0))] * 4 + [(2, 20.0)] * 4


def test_flowers_loop_refuses_a_second_start_of_the_same_strategy(tmp_path: Path) -> None:
    """As start's own loop does: the second run would otherwise continue the first one's
    ledger from the initial arrays, recorded as a change made outside lensemble."""
    _, grid = stock_loop_federation(tmp_path)
    strategy = _DecayingLearningRate(small_config(min_participants=3), run_dir=tmp_path / "run")
    initial = arrays_to_record(initial_params())
    strategy.start(grid=grid, initial_arrays=initial, num_rounds=1)
    pushed = len(grid.pushed())
    with pytest.raises(StoreError, match="already holds a run"):
        strategy.start(grid=grid, initial_arrays=initial, num_rounds=1)
    assert len(grid.pushed()) == pushed
    assert [r.round for r in verify(Store(tmp_path / "run"))] == [1]


def test_start_calls_a_round_hook_set_on_the_object(tmp_path: Path) -> None:
    _, grid = stock_loop_federation(tmp_path)
    strategy = LensembleStrategy(small_config(min_participants=3), run_dir=tmp_path / "run")
    original, rounds = strategy.aggregate_train, []
    configure, evaluated = strategy.configure_evaluate, []

    def aggregate_train(server_round: int, replies: Any) -> Any:
        rounds.append(server_round)
        return original(server_round, replies)

    def configure_evaluate(server_round: int, *args: Any) -> Any:
        evaluated.append(server_round)
        return configure(server_round, *args)

    strategy.aggregate_train = aggregate_train  # type: ignore[method-assign]
    strategy.configure_evaluate = configure_evaluate  # type: ignore[method-assign]
    strategy.start(grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2)
    assert rounds == [1, 2] and evaluated == [1, 2]


def test_aggregate_train_of_too_few_replies_aborts_and_returns_no_arrays(tmp_path: Path) -> None:
    strategy, grid = stock_loop_federation(tmp_path)
    arrays = arrays_to_record(initial_params())
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    replies = grid.send_and_receive(messages[:2])  # quorum is 3
    new, metrics = strategy.aggregate_train(1, replies)
    assert new is None and metrics is not None and metrics["lensemble.C_t"] == 0.0
    assert strategy.coordinator is not None and strategy.coordinator.global_state().round == 0
    # the retry is attempt 2 of the same round, and succeeds with every node
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    assert all(m.content["config"]["lensemble.attempt"] == 2 for m in messages)
    new, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert new is not None and metrics["lensemble.C_t"] == 4.0


def test_configure_evaluate_sends_the_global_arrays_and_aggregate_averages() -> None:
    strategy = LensembleStrategy(small_config(), fraction_evaluate=0.5)
    grid = FakeGrid(FakeClock(), {n: (lambda m: None) for n in NODES})
    arrays = arrays_to_record(initial_params())
    messages = list(strategy.configure_evaluate(2, arrays, ConfigRecord({"k": 1}), grid))
    assert len(messages) == 2
    assert messages[0].content["config"]["server-round"] == 2
    assert set(messages[0].content["arrays"].keys()) == set(arrays.keys())

    def reply(message, loss: float, count: int) -> Message:
        metrics = MetricRecord({"loss": loss, "num-examples": count})
        return Message(RecordDict({"metrics": metrics}), reply_to=message)

    grid.push_messages(messages)  # names them, so that replies can refer to them
    replies = [reply(messages[0], 1.0, 10), reply(messages[1], 4.0, 30)]
    averaged = strategy.aggregate_evaluate(2, replies)
    assert averaged is not None and averaged["loss"] == pytest.approx(3.25)  # by examples


def test_evaluation_metrics_do_not_depend_on_the_order_replies_arrive_in() -> None:
    """Floating-point sums depend on their order: the replies are summed in the nodes'
    order, so two runs report the same metrics to the last bit."""
    strategy = LensembleStrategy(small_config(), fraction_evaluate=1.0)
    grid = FakeGrid(FakeClock(), {n: (lambda m: None) for n in NODES})
    messages = list(
        strategy.configure_evaluate(1, arrays_to_record(initial_params()), ConfigRecord(), grid)
    )
    grid.push_messages(messages)
    losses = [0.1, 1e16, -1e16, 0.7]  # a sum whose value depends on the order
    replies = [
        Message(
            RecordDict({"metrics": MetricRecord({"loss": loss, "num-examples": 1})}),
            reply_to=message,
        )
        for message, loss in zip(messages, losses, strict=True)
    ]
    seen = {
        strategy.aggregate_evaluate(1, order)["loss"]  # type: ignore[index]
        for order in (replies, replies[::-1], replies[1:] + replies[:1])
    }
    assert len(seen) == 1


def test_evaluation_replies_left_out_of_the_average_are_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """FedAvg stops the run on an evaluate reply without ``num-examples``; lensemble has
    committed the round already, so it leaves such replies out and says which, and why."""
    strategy = LensembleStrategy(small_config(), fraction_evaluate=1.0)
    grid = FakeGrid(FakeClock(), {n: (lambda m: None) for n in NODES})
    messages = list(
        strategy.configure_evaluate(3, arrays_to_record(initial_params()), ConfigRecord(), grid)
    )
    grid.push_messages(messages)
    good, no_count, zero, failed = messages

    def reply(message: Message, metrics: dict) -> Message:
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=message)

    replies = [
        reply(good, {"loss": 2.0, "num-examples": 5}),
        reply(no_count, {"loss": 9.0}),
        reply(zero, {"loss": 9.0, "num-examples": 0}),
        Message(Error(code=0, reason="ClientApp raised"), reply_to=failed),
    ]
    with caplog.at_level(logging.WARNING, logger="lensemble_flwr"):
        averaged = strategy.aggregate_evaluate(3, replies)
    assert averaged is not None and averaged["loss"] == 2.0
    (line,) = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert line.startswith("round 3: 3 evaluation replies left out of the aggregated metrics")
    assert f"node-{no_count.metadata.dst_node_id} (no 'num-examples' in its MetricRecord)" in line
    assert "'num-examples' is 0, not a finite number > 0" in line
    assert "(error 0: ClientApp raised)" in line


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("lensemble.outer-lrr", 1.0),
        ("lensemble.outer-lr", -1.0),
        ("lensemble.min-participants", "many"),
    ],
)
def test_the_app_stops_on_a_bad_run_config_key_naming_it(key: str, value: object) -> None:
    context = Context(
        run_id=1,
        node_id=0,
        node_config={},
        state=RecordDict(),
        run_config={"num-server-rounds": 1, key: value},
    )  # type: ignore[dict-item]

    class NoGrid:
        def __getattr__(self, name: str) -> None:
            raise AssertionError("the grid was used before the config was checked")

    with pytest.raises(ConfigError, match=f"^{key}"):
        digits.main(NoGrid(), context)  # type: ignore[arg-type]


def test_a_restarted_server_app_resumes_the_run_to_the_same_total(tmp_path: Path) -> None:
    strategy, grid = stock_loop_federation(tmp_path)
    initial = arrays_to_record(initial_params())
    strategy.start(grid=grid, initial_arrays=initial, num_rounds=2)
    before = [r.record_hash for r in verify(Store(tmp_path / "run"))]
    # a new ServerApp process: a new strategy object on the same run directory
    again = LensembleStrategy(
        strategy.config,
        run_dir=tmp_path / "run",
        run_id="stock-loop",
        fraction_evaluate=0.0,
        resume=True,
    )
    evaluated: list[int] = []
    result = again.start(
        grid=grid,
        initial_arrays=initial,
        num_rounds=3,
        evaluate_fn=lambda r, arrays: evaluated.append(r),  # type: ignore[func-returns-value]
    )
    assert evaluated == [3]  # not round 0 again: the initial arrays are not where it resumed
    records = verify(Store(tmp_path / "run"))
    assert [r.record_hash for r in records[:2]] == before  # nothing committed was lost
    assert [r.round for r in records] == [1, 2, 3]
    assert list(result.train_metrics_clientapp) == [3]  # one more round, not three
    with pytest.raises(StoreError, match=r"already holds a run.*resume=True"):  # how to go on
        LensembleStrategy(strategy.config, run_dir=tmp_path / "run", fraction_evaluate=0.0).start(
            grid=grid, initial_arrays=initial, num_rounds=1
        )


def test_a_resumed_run_with_no_round_left_says_so_and_returns_its_model(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """num_rounds counts from round 1: resuming a run that holds them all runs nothing,
    waits for no node, says so, and hands back the run's model, not the initial one."""
    strategy, grid = stock_loop_federation(tmp_path)
    initial = arrays_to_record(initial_params())
    strategy.start(grid=grid, initial_arrays=initial, num_rounds=2)
    pushes = len(grid.pushes)
    again = LensembleStrategy(
        strategy.config, run_dir=tmp_path / "run", run_id="stock-loop",
        fraction_evaluate=0.0, resume=True,
    )  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.INFO):
        result = again.start(grid=grid, initial_arrays=initial, num_rounds=2)
    assert len(grid.pushes) == pushes and result.train_metrics_clientapp == {}
    assert "already holds round 2, and num_rounds = 2 counts from round 1" in caplog.text
    assert "warm-up:" not in caplog.text
    assert again.coordinator is not None
    final = record_to_arrays(result.arrays)
    for name, array in again.coordinator.global_state().params.items():
        np.testing.assert_array_equal(final[name], array)
    assert any(
        not np.array_equal(final[n], a) for n, a in record_to_arrays(initial).items()
    )


def test_zero_rounds_run_nothing_and_say_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    strategy, grid = stock_loop_federation(tmp_path)
    with caplog.at_level(logging.INFO):
        strategy.start(grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=0)
    assert grid.pushes == [] and "num_rounds = 0: no round to run" in caplog.text
    assert "already holds" not in caplog.text


def test_the_stock_loop_applies_the_attempt_limit(tmp_path: Path) -> None:
    """Too few replies twice with max-round-attempts 2: the second aggregate_train raises
    the round's error (as Coordinator.run would) instead of returning normally."""
    config = small_config(min_participants=3, max_round_attempts=2)
    strategy, grid = stock_loop_federation(tmp_path, config)
    arrays = arrays_to_record(initial_params())
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    assert strategy.aggregate_train(1, grid.send_and_receive(messages[:2]))[0] is None
    messages = list(strategy.configure_train(2, arrays, ConfigRecord(), grid))
    with pytest.raises(FaultToleranceExceeded, match="quorum 3"):
        strategy.aggregate_train(2, grid.send_and_receive(messages[:2]))
    assert strategy.coordinator is not None
    assert [o.attempt for o in strategy.coordinator.outcomes] == [1, 2]


def test_the_stock_loop_refuses_masked_rounds_before_anything(tmp_path: Path) -> None:
    """Masked rounds need an unmask exchange that configure_train/aggregate_train cannot
    make: Flower's own Strategy.start fails at once, saying to call start()."""
    config = small_config(min_participants=3, secagg_threshold=3)
    strategy, grid = stock_loop_federation(tmp_path, config)
    with pytest.raises(ConfigError, match=r"LensembleStrategy\.start\(\)"):
        Strategy.start(
            strategy, grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2
        )
    assert strategy.coordinator is None and not (tmp_path / "run").exists()
    assert grid.pushes == []


def test_aggregate_train_without_configure_train_is_refused(tmp_path: Path) -> None:
    strategy, _grid = stock_loop_federation(tmp_path)
    with pytest.raises(RuntimeError, match="configure_train"):
        strategy.aggregate_train(1, [])


def test_run_directory_writes_are_fsynced_except_on_the_simulation_engine(
    tmp_path: Path,
) -> None:
    """By default a deployment's run directory survives a power loss (every write
    fsynced); on the simulation engine, whose participants' state lives in its memory, it
    survives a killed process only. ``durable_writes`` decides either way."""
    from flwr.superlink.grid import InMemoryGrid

    class SimulationGrid(InMemoryGrid):
        def __init__(self) -> None:  # no LinkState: only its type is asked
            pass

    deployment = FakeGrid(FakeClock(), {})
    assert LensembleStrategy(small_config()).writes_durably(deployment) is True
    assert LensembleStrategy(small_config()).writes_durably(SimulationGrid()) is False
    for durable in (True, False):
        strategy = LensembleStrategy(small_config(), durable_writes=durable)
        assert strategy.writes_durably(SimulationGrid()) is durable
        assert strategy.writes_durably(deployment) is durable
    # and the coordinator's store is opened so
    strategy, grid = stock_loop_federation(tmp_path)
    Strategy.start(
        strategy, grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=1
    )
    assert strategy.coordinator is not None and strategy.coordinator.store.sync is True


@pytest.mark.parametrize("durable", [True, False])
def test_the_round_metrics_file_is_as_durable_as_the_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool
) -> None:
    """``round-metrics.jsonl`` follows ``durable_writes`` (on the simulation engine, off):
    it used to be fsynced every round whatever the store did."""
    from lensemble_flwr.strategies import reporting as strategy_module

    seen: list[bool] = []
    append = strategy_module.append_round_metrics

    def recording(run_dir, server_round, kinds, *, durable=True):  # type: ignore[no-untyped-def]
        seen.append(durable)
        return append(run_dir, server_round, kinds, durable=durable)

    monkeypatch.setattr(strategy_module, "append_round_metrics", recording)
    strategy, grid = stock_loop_federation(tmp_path, durable_writes=durable)
    strategy.start(grid, arrays_to_record(initial_params()), num_rounds=2)
    assert seen == [durable, durable]
    assert strategy.coordinator is not None and strategy.coordinator.store.sync is durable


def test_start_asks_no_node_to_evaluate_in_masked_rounds(tmp_path: Path) -> None:
    """Under secure aggregation (or DP) the participants release no per-node metrics, so
    ``start()`` sends no evaluate instructions, as ``configure_evaluate`` already did not:
    it used to ask every round, costing an exchange that every node refused (and a stock
    ClientApp would have answered with its un-noised metrics)."""
    config = small_config(min_participants=3, secagg_threshold=3)
    grid = clientapp_grid(config)
    strategy = LensembleStrategy(config, run_dir=tmp_path / "run", run_id="masked")
    default = inspect.signature(LensembleStrategy).parameters["fraction_evaluate"].default
    assert default == 1.0  # FedAvg's default: evaluation was asked for
    result = strategy.start(
        grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2
    )
    assert [r.count for r in verify(Store(tmp_path / "run"))] == [4, 4]
    kinds = {m.metadata.message_type for m in grid.pushed()}
    assert kinds == {MessageType.TRAIN}, kinds
    assert result.evaluate_metrics_clientapp == {}


def _server_evaluation(seen: list[int]) -> Any:
    """An evaluate_fn whose metrics name the round it evaluated."""

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        seen.append(server_round)
        return MetricRecord({"loss": 1.0 / (server_round + 1), "accuracy": 0.1 * server_round})

    return evaluate


def _metrics_lines(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "round-metrics.jsonl").read_text().splitlines()]


def test_start_writes_the_server_and_federated_evaluation_into_the_round_metrics(
    tmp_path: Path,
) -> None:
    """round-metrics.jsonl holds evaluate_fn's metrics under ``server`` (round 0: the
    initial model's) and the aggregated federated evaluation under ``evaluate``, beside
    the train replies' metrics: what ``lensemble-flwr report`` draws."""
    config = small_config(min_participants=3)
    grid = _evaluating_federation(config)
    seen: list[int] = []
    strategy = LensembleStrategy(config, run_dir=tmp_path / "run", run_id="evaluated")
    result = strategy.start(
        grid=grid,
        initial_arrays=arrays_to_record(initial_params()),
        num_rounds=2,
        evaluate_fn=_server_evaluation(seen),
    )
    assert seen == [0, 1, 2]
    lines = _metrics_lines(tmp_path / "run")
    assert [line["round"] for line in lines] == [0, 1, 2]
    assert lines[0] == {
        "round": 0,
        "train": {},
        "evaluate": {},
        "server": {"loss": 1.0, "accuracy": 0.0},
    }
    mean = (0.5 + 0.6 + 0.7 + 0.8) / 4
    for r, line in zip((1, 2), lines[1:], strict=True):
        assert line["server"] == {"loss": pytest.approx(1.0 / (r + 1)), "accuracy": 0.1 * r}
        assert line["evaluate"]["accuracy"] == pytest.approx(mean)
        assert line["train"]["lensemble.C_t"] == 4.0
        assert dict(result.evaluate_metrics_serverapp[r]) == line["server"]
    back = read_round_metrics(tmp_path / "run")
    assert sorted(back) == [0, 1, 2] and back[0]["server"]["loss"] == 1.0


@pytest.mark.parametrize("private", ["masked", "dp"])
def test_a_masked_or_private_run_records_its_server_evaluation(
    tmp_path: Path, private: str
) -> None:
    """Under secure aggregation or DP no node evaluates (nothing new leaves a node), and
    the server's evaluate_fn, which sees only the global model, is still recorded."""
    config = (
        small_config(min_participants=3, secagg_threshold=3)
        if private == "masked"
        else dp_config(tmp_path, dp_state_dir="", dp_epsilon=9.0, noise_multiplier=3.0)
    )
    contexts = {  # a budget needs a stable identity: names of this test's own
        n: Context(
            run_id=1,
            node_id=n,
            node_config={"lensemble-id": f"evaluated-{private}-{i}"},
            state=RecordDict(),
            run_config={},
        )
        for i, n in enumerate(NODES)
    }
    grid = FakeGrid(
        FakeClock(), {n: clientapp_node(i, contexts[n], config) for i, n in enumerate(NODES)}
    )
    seen: list[int] = []
    strategy = LensembleStrategy(config, run_dir=tmp_path / "run", run_id=private)
    strategy.start(
        grid=grid,
        initial_arrays=arrays_to_record(initial_params()),
        num_rounds=2,
        evaluate_fn=_server_evaluation(seen),
    )
    assert {m.metadata.message_type for m in grid.pushed()} == {MessageType.TRAIN}
    lines = _metrics_lines(tmp_path / "run")
    assert [(line["round"], sorted(line["server"])) for line in lines] == [
        (r, ["accuracy", "loss"]) for r in (0, 1, 2)
    ]
    assert all(line["evaluate"] == {} for line in lines)


def _train_rounds_pushed(grid: FakeGrid) -> list[int]:
    """The round of each train instruction pushed so far, in push order."""
    return [
        int(m.metadata.group_id)
        for m in grid.pushed()
        if m.metadata.message_type == MessageType.TRAIN
    ]


class _TrainPushedWhenReported(logging.Handler):
    """At each "Aggregated MetricRecord" line Flower's logger prints, the latest round
    whose train instructions were pushed."""

    def __init__(self, grid: FakeGrid) -> None:
        super().__init__()
        self.grid = grid
        self.latest: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "Aggregated MetricRecord" in record.getMessage():
            self.latest.append(max(_train_rounds_pushed(self.grid)))


def test_the_next_round_trains_while_the_server_reports_the_last(tmp_path: Path) -> None:
    """With nothing to evaluate between the rounds, round r + 1's instructions go out as
    soon as round r commits: its metrics and log lines are written while the nodes
    train. Every round is still one attempt with one instruction per node, and the last
    round opens nothing after it."""
    strategy, grid = stock_loop_federation(tmp_path)
    seen = _TrainPushedWhenReported(grid)
    logging.getLogger("flwr").addHandler(seen)
    try:
        result = strategy.start(
            grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=3
        )
    finally:
        logging.getLogger("flwr").removeHandler(seen)
    assert seen.latest == [2, 3, 3]
    assert _train_rounds_pushed(grid) == [r for r in (1, 2, 3) for _ in NODES]
    coordinator = strategy.coordinator
    assert coordinator is not None
    assert [(o.round, o.attempt) for o in coordinator.outcomes] == [(1, 1), (2, 1), (3, 1)]
    assert [(o.round, o.attempt) for o in result.outcomes] == [(1, 1), (2, 1), (3, 1)]
    assert [r.round for r in verify(Store(tmp_path / "run"))] == [1, 2, 3]


@pytest.mark.parametrize("user_code", ["evaluate_fn", "on_round", "train_metrics_aggr_fn"])
def test_with_user_code_between_rounds_the_next_round_waits_for_it(
    tmp_path: Path, user_code: str
) -> None:
    """``evaluate_fn(r)``, ``on_round`` and a train metrics aggregation of the user's run
    before round r + 1's instructions go out, as with FedAvg: instructions pushed before
    them, and pulled only after them, could outlive their TTL on a SuperLink while slow
    user code runs (the SuperLink then drops the replies)."""
    latest: list[int] = []
    grid_of: dict[str, FakeGrid] = {}

    def slow() -> None:  # longer than any instruction's TTL
        grid = grid_of["grid"]
        latest.append(max(_train_rounds_pushed(grid)))
        grid.clock.t += 1000.0

    def evaluate_fn(server_round: int, arrays: object) -> MetricRecord:
        if server_round > 0:
            slow()
        return MetricRecord({"seen": float(server_round)})

    def aggregate(contents: list[RecordDict], key: str) -> MetricRecord:
        slow()
        return MetricRecord()

    arguments: dict[str, Any] = {}
    if user_code == "on_round":
        arguments["on_round"] = lambda line: slow()
    if user_code == "train_metrics_aggr_fn":
        arguments["train_metrics_aggr_fn"] = aggregate
    strategy, grid = stock_loop_federation(tmp_path, **arguments)
    grid_of["grid"] = grid
    result = strategy.start(
        grid=grid,
        initial_arrays=arrays_to_record(initial_params()),
        num_rounds=3,
        evaluate_fn=evaluate_fn if user_code == "evaluate_fn" else None,
    )
    assert latest == [1, 2, 3]  # each ran before the next round's instructions went out
    assert grid.errors == []  # no instruction waited on the SuperLink meanwhile
    assert [(o.round, o.attempt) for o in result.outcomes] == [(1, 1), (2, 1), (3, 1)]


def test_an_attempt_that_fails_as_it_opens_ahead_is_reported_with_its_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An attempt opened ahead that ends ABORTED as its instructions go out belongs to
    the next round's outcomes and counts (``result.aborted``, ``lensemble.attempts``)."""
    strategy, grid = stock_loop_federation(tmp_path)
    send = GridTransport.send

    def flaky_send(self: GridTransport, peer: str, message: object) -> None:
        if isinstance(message, RoundOpen) and (message.round, message.attempt) == (2, 1):
            raise FaultToleranceExceeded("the link dropped round 2's first instructions")
        send(self, peer, message)  # type: ignore[arg-type]

    monkeypatch.setattr(GridTransport, "send", flaky_send)
    result = strategy.start(
        grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2
    )
    assert [(o.round, o.attempt) for o in result.outcomes] == [(1, 1), (2, 1), (2, 2)]
    assert list(result.aborted) == [2]
    assert "dropped round 2" in result.aborted[2][0]
    assert result.train_metrics_clientapp[1]["lensemble.attempts"] == 1.0
    assert result.train_metrics_clientapp[2]["lensemble.attempts"] == 2.0


def test_an_error_opening_the_next_round_is_raised_once_this_one_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push that fails outright (not a round error: a broken link to the SuperLink)
    ends ``start``, but only after the committed round's metrics were written."""
    strategy, grid = stock_loop_federation(tmp_path)
    push = grid.push_messages

    def broken_push(messages: Any) -> list[str]:
        batch = list(messages)
        if any(m.metadata.group_id == "2" for m in batch):
            raise ConnectionError("the SuperLink went away")
        return push(batch)

    monkeypatch.setattr(grid, "push_messages", broken_push)
    with pytest.raises(ConnectionError, match="went away"):
        strategy.start(grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=3)
    lines = (tmp_path / "run" / "round-metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [1]
    # the attempt that could not go out is over (recorded), not left open
    coordinator = strategy.coordinator
    assert coordinator is not None and coordinator.round_state() is RoundState.ABORTED
    assert "could not be sent: ConnectionError" in str(coordinator.outcomes[-1].reason)


def test_with_federated_evaluation_the_nodes_evaluate_before_they_train_again(
    tmp_path: Path,
) -> None:
    """FedAvg's order: round r's evaluate instructions are pushed before round r + 1's
    train instructions (the next round is not opened ahead)."""
    strategy, grid = stock_loop_federation(tmp_path, fraction_evaluate=1.0)
    strategy.start(grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=3)
    kinds = [
        (batch[0].metadata.message_type, int(batch[0].metadata.group_id or 0))
        for batch in grid.pushes
        if batch
    ]
    train, evaluate = MessageType.TRAIN, MessageType.EVALUATE
    order = [(kind, r) for kind, r in kinds if kind in (train, evaluate)]
    assert [kind for kind, _ in order] == [train, evaluate] * 3
    assert [r for kind, r in order if kind == train] == [1, 2, 3]


def _stray_arrays(message: Message) -> Message:
    """A stock reply with an array the model does not have."""
    content = RecordDict(
        {
            "arrays": ArrayRecord({"not-in-the-model": Array(np.zeros(3, np.float32))}),
            "metrics": MetricRecord({"num-examples": 4}),
        }
    )
    return Message(content, reply_to=message)


def test_a_node_that_answers_without_an_update_is_counted_as_refused(tmp_path: Path) -> None:
    """A reply that cannot become an update (here, an array the model does not have) is
    the node's refusal: ``lensemble.refused`` counts it, ``lensemble.rejected`` (messages
    refused at ingress) does not."""
    strategy, grid = stock_loop_federation(tmp_path)
    grid.nodes[NODES[0]] = _stray_arrays
    result = strategy.start(
        grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=1
    )
    metrics = result.train_metrics_clientapp[1]
    assert metrics["lensemble.C_t"] == 3.0
    assert metrics["lensemble.refused"] == 1.0 and metrics["lensemble.rejected"] == 0.0
    (outcome,) = result.outcomes
    assert outcome.refused == (f"node-{NODES[0]}",)


def test_flowers_own_loop_counts_a_malformed_reply_as_that_nodes_refusal(
    tmp_path: Path,
) -> None:
    """In ``aggregate_train`` too, a reply that cannot become an update is the node's
    refusal (``lensemble.refused``), as in ``start``."""
    strategy, grid = stock_loop_federation(tmp_path)
    grid.nodes[NODES[0]] = _stray_arrays
    result = Strategy.start(
        strategy, grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=1
    )
    metrics = result.train_metrics_clientapp[1]
    assert metrics["lensemble.C_t"] == 3.0
    assert metrics["lensemble.refused"] == 1.0 and metrics["lensemble.rejected"] == 0.0


def test_an_evaluation_error_without_a_reason_or_from_the_superlink_is_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Flower turns an empty error reason into None, and the SuperLink answers for a node
    whose evaluate instruction expired: neither crashes the aggregation, and the SuperLink
    is named as such, not as a node."""
    strategy = LensembleStrategy(small_config(), fraction_evaluate=1.0)
    grid = FakeGrid(FakeClock(), {n: (lambda m: None) for n in NODES})
    messages = list(
        strategy.configure_evaluate(2, arrays_to_record(initial_params()), ConfigRecord(), grid)
    )
    grid.push_messages(messages)
    expired = create_message_error_unavailable_ins_message(messages[1].metadata.message_id, 1)
    replies = [Message(Error(code=0), reply_to=messages[0]), expired]
    with caplog.at_level(logging.WARNING, logger="lensemble_flwr"):
        assert strategy.aggregate_evaluate(2, replies) is None
    (line,) = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert f"node-{messages[0].metadata.dst_node_id} (error 0: no reason given)" in line
    assert "the SuperLink (error 3:" in line and "node-1 " not in line


class _KeepsItsOwnNames(LensembleStrategy):
    """As Flower's advanced-pytorch example: attributes of its own named as lensemble's
    settings (its W&B run name under ``run_dir``), set before and after the constructor."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.config = {"lr": 0.1}
        super().__init__(*args, **kwargs)
        self.run_dir = "wandb-run-name"
        self.coordinator = "not lensemble's"

    def aggregate_train(self, server_round: int, replies: Any) -> Any:
        assert self.run_dir == "wandb-run-name" and self.config == {"lr": 0.1}
        return super().aggregate_train(server_round, replies)


def test_a_subclasss_own_run_dir_config_and_coordinator_do_not_redirect_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lensemble keeps its state privately: the run goes where the constructor said,
    with the constructor's config, and the subclass keeps its own values."""
    monkeypatch.chdir(tmp_path)
    _, grid = stock_loop_federation(tmp_path)
    config = small_config(min_participants=3)
    strategy = _KeepsItsOwnNames(config, run_dir=tmp_path / "run", fraction_evaluate=0.0)
    result = strategy.start(
        grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2
    )
    assert result.run_dir == tmp_path / "run"
    assert [r.round for r in verify(Store(tmp_path / "run"))] == [1, 2]
    assert not (tmp_path / "wandb-run-name").exists()
    assert strategy.run_dir == "wandb-run-name" and strategy.config == {"lr": 0.1}
    assert strategy.coordinator == "not lensemble's"
    # the read-only views give lensemble's values where nothing shadows them
    plain, grid = stock_loop_federation(tmp_path / "plain", config)
    assert plain.run_dir == tmp_path / "plain" / "run" and plain.config == config
    assert plain.coordinator is None and plain.transport is None
    plain.start(grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=1)
    assert plain.coordinator is not None and plain.coordinator.global_state().round == 1
    assert isinstance(plain.transport, GridTransport)


class _DropsAReply(LensembleStrategy):
    """Hands the default aggregate_train all replies but the first."""

    def aggregate_train(self, server_round: int, replies: Any) -> Any:
        return super().aggregate_train(server_round, list(replies)[1:])


def test_replies_an_override_leaves_out_are_in_the_round_all_the_same_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """In start, each update is admitted as it arrives: what aggregate_train hands the
    default does not choose the contributors. The round says so, and its ledger record
    names every contributor."""
    _, grid = stock_loop_federation(tmp_path)
    strategy = _DropsAReply(
        small_config(min_participants=3), run_dir=tmp_path / "run", fraction_evaluate=0.0
    )
    with caplog.at_level(logging.WARNING):
        result = strategy.start(
            grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=1
        )
    assert result.train_metrics_clientapp[1]["lensemble.C_t"] == 4.0
    assert [r.count for r in verify(Store(tmp_path / "run"))] == [4]
    assert "aggregate_train was handed 3 of the attempt's 4 replies" in caplog.text


class _AggregatesOnItsOwn(LensembleStrategy):
    """An aggregate_train that never calls the default (and returns nothing)."""

    def aggregate_train(self, server_round: int, replies: Any) -> Any:
        self.seen = [*getattr(self, "seen", []), len(list(replies))]
        return None, None


def test_an_aggregate_train_that_skips_the_default_still_ends_each_round(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """lensemble ends the attempt over what it admitted, says so, and the round's
    metrics and model are lensemble's (the override returned none)."""
    _, grid = stock_loop_federation(tmp_path)
    strategy = _AggregatesOnItsOwn(
        small_config(min_participants=3), run_dir=tmp_path / "run", fraction_evaluate=0.0
    )
    with caplog.at_level(logging.WARNING):
        result = strategy.start(
            grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2
        )
    assert strategy.seen == [4, 4]
    assert "aggregate_train did not call LensembleStrategy.aggregate_train" in caplog.text
    assert [r.round for r in verify(Store(tmp_path / "run"))] == [1, 2]
    assert result.train_metrics_clientapp[2]["lensemble.C_t"] == 4.0
    coordinator = strategy.coordinator
    assert coordinator is not None
    final = record_to_arrays(result.arrays)
    for name, array in coordinator.global_state().params.items():
        np.testing.assert_array_equal(final[name], array)


class _SendsItsOwnMessages(LensembleStrategy):
    """A configure_train that rebuilds every instruction as a Message of its own."""

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Any
    ) -> Any:
        return [
            Message(
                content=m.content,
                dst_node_id=m.metadata.dst_node_id,
                message_type=MessageType.TRAIN,
            )
            for m in super().configure_train(server_round, arrays, config, grid)
        ]


def test_messages_a_configure_train_makes_itself_are_the_attempts_instructions(
    tmp_path: Path,
) -> None:
    """Each goes out as the attempt's instruction to its node, with the instructions' TTL
    and group, and its reply counts as that node's answer."""
    _, grid = stock_loop_federation(tmp_path)
    strategy = _SendsItsOwnMessages(
        small_config(min_participants=3), run_dir=tmp_path / "run", fraction_evaluate=0.0,
        warmup_timeout=0.0,
    )  # fmt: skip
    result = strategy.start(
        grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2
    )
    assert [r.count for r in verify(Store(tmp_path / "run"))] == [4, 4]
    assert result.train_metrics_clientapp[2]["lensemble.exchanges"] == 1.0
    pushed = [(int(m.metadata.group_id), m.metadata.ttl) for m in grid.pushed()]
    assert pushed == [(1, 20.0)] * len(NODES) + [(2, 20.0)] * len(NODES)


class _BeginsNothing(LensembleStrategy):
    """A configure_train that never calls the default (so no attempt begins)."""

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Any
    ) -> Any:
        return []


def test_a_configure_train_that_begins_no_attempt_is_refused_saying_why(tmp_path: Path) -> None:
    _, grid = stock_loop_federation(tmp_path)
    strategy = _BeginsNothing(
        small_config(min_participants=3), run_dir=tmp_path / "run", fraction_evaluate=0.0
    )
    with pytest.raises(RuntimeError, match=r"must call super\(\)\.configure_train"):
        strategy.start(grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=1)
    assert grid.pushed() == [] and verify(Store(tmp_path / "run")) == []


class _HookOrder(LensembleStrategy):
    """Records each round hook as it is entered and left; the defaults do the work."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, int]] = []

    def aggregate_evaluate(self, server_round: int, replies: Any) -> MetricRecord | None:
        self.calls.append(("aggregate_evaluate", server_round))
        return super().aggregate_evaluate(server_round, replies)

    def aggregate_train(self, server_round: int, replies: Any) -> Any:
        self.calls.append(("aggregate_train", server_round))
        returned = super().aggregate_train(server_round, replies)
        self.calls.append(("aggregate_train returned", server_round))
        return returned

    def configure_train(self, server_round: int, *args: Any) -> Any:
        self.calls.append(("configure_train", server_round))
        return super().configure_train(server_round, *args)


def test_with_lensembles_own_hooks_the_next_round_goes_out_before_the_metrics_are_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no code of the user's anywhere between two rounds (round hooks included),
    round r + 1's instructions are pushed as soon as round r commits, before
    ``aggregate_train`` makes round r's metrics (and its returned arrays)."""
    from lensemble_flwr.strategies import reporting

    strategy, grid = stock_loop_federation(tmp_path)
    latest: list[int] = []
    round_metrics = reporting.round_metrics

    def seen(outcome: Any, *args: Any, **kwargs: Any) -> MetricRecord:
        latest.append(max(_train_rounds_pushed(grid)))
        return round_metrics(outcome, *args, **kwargs)

    monkeypatch.setattr(reporting, "round_metrics", seen)
    result = strategy.start(
        grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=3
    )
    assert latest == [2, 3, 3]
    assert _train_rounds_pushed(grid) == [r for r in (1, 2, 3) for _ in NODES]
    assert [(o.round, o.attempt) for o in result.outcomes] == [(1, 1), (2, 1), (3, 1)]
    assert [r.round for r in verify(Store(tmp_path / "run"))] == [1, 2, 3]


def test_with_a_round_hook_of_the_users_the_hooks_keep_flowers_order(tmp_path: Path) -> None:
    """An overridden round hook sees Flower's order: round r's ``aggregate_train``
    returns and its ``aggregate_evaluate`` runs before round r + 1's ``configure_train``."""
    config = small_config(min_participants=3)
    grid = clientapp_grid(config)
    strategy = _HookOrder(
        config, run_dir=tmp_path / "run", run_id="hook-order", fraction_evaluate=0.0
    )
    strategy.start(grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2)
    assert strategy.calls == [
        ("configure_train", 1),
        ("aggregate_train", 1),
        ("aggregate_train returned", 1),
        ("aggregate_evaluate", 1),
        ("configure_train", 2),
        ("aggregate_train", 2),
        ("aggregate_train returned", 2),
        ("aggregate_evaluate", 2),
    ]


def test_fedavgs_attributes_read_as_in_fedavg(tmp_path: Path) -> None:
    """An override copied from a FedAvg subclass reads FedAvg's attributes; they say what
    the constructor was given (FedAvg's sampling arguments through the config)."""

    def metrics(records: list[RecordDict], key: str) -> MetricRecord:
        return MetricRecord({})

    strategy = LensembleStrategy(
        small_config(), run_dir=tmp_path / "run", fraction_train=0.5, min_train_nodes=2,
        min_available_nodes=3, fraction_evaluate=0.25, min_evaluate_nodes=1,
        weighted_by_key="n", arrayrecord_key="w", configrecord_key="c",
        train_metrics_aggr_fn=metrics, evaluate_metrics_aggr_fn=metrics, on_round=print,
    )  # fmt: skip
    assert (strategy.fraction_train, strategy.min_train_nodes) == (0.5, 2)
    assert strategy.min_available_nodes == 3
    assert (strategy.fraction_evaluate, strategy.min_evaluate_nodes) == (0.25, 1)
    assert (strategy.weighted_by_key, strategy.arrayrecord_key) == ("n", "w")
    assert strategy.configrecord_key == "c" and strategy.on_round is print
    assert strategy.train_metrics_aggr_fn is metrics is strategy.evaluate_metrics_aggr_fn


class _FlowerLines(logging.Handler):
    """Every line Flower's logger prints (its stream), in order."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelno, record.getMessage()))


def test_a_dp_run_says_its_plan_before_round_1_and_keeps_its_round_metrics(
    tmp_path: Path,
) -> None:
    """Under DP the stream says the privacy plan (and the forecast's warning) before round
    1, says once that no node evaluates, and each round's line keeps the ServerApp's own
    evaluation and the epsilon spent (nodes release no metrics under DP)."""
    from flwr.common.logger import FLOWER_LOGGER

    # the nodes keep their budgets where their owner does (the tests' default directory)
    config = dp_config(tmp_path, noise_multiplier=5.0, dp_epsilon=10.0, dp_state_dir="")
    contexts = {  # a DP node keeps its budget under a stable identity: its partition id
        n: Context(run_id=1, node_id=n, node_config={"partition-id": i}, state=RecordDict(),
                   run_config={})
        for i, n in enumerate(NODES)
    }  # fmt: skip
    nodes = {n: clientapp_node(i, contexts[n], config) for i, n in enumerate(NODES)}
    grid = FakeGrid(FakeClock(), nodes)
    said: list[str] = []
    strategy = LensembleStrategy(
        config, run_dir=tmp_path / "run", run_id="dp", on_round=said.append
    )
    stream = _FlowerLines()
    FLOWER_LOGGER.addHandler(stream)
    try:
        strategy.start(
            grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2,
            evaluate_fn=lambda r, arrays: MetricRecord({"accuracy": 0.5}),
        )  # fmt: skip
    finally:
        FLOWER_LOGGER.removeHandler(stream)
    messages = [m for _, m in stream.lines]
    plan = next(i for i, m in enumerate(messages) if "privacy plan: local Gaussian" in m)
    warned = next(i for i, m in enumerate(messages) if "not expected to learn" in m)
    first_round = messages.index("[ROUND 1/2]")
    assert plan < warned < first_round
    assert stream.lines[warned][0] == logging.WARNING
    assert sum("no federated evaluation" in m for m in messages) == 1
    assert len(said) == 2
    for line in said:
        assert "server-accuracy=0.5000" in line and "epsilon=" in line


def test_adaptive_deadlines_in_start_set_each_attempts_ttl_and_are_reported(
    tmp_path: Path,
) -> None:
    """Round 1 waits (and its instructions live) for the cap; round 2 for the margin times
    round 1's time, within the floor and cap: each round's metrics say what it waited
    for, and its instructions' TTL is those deadlines."""
    config = small_config(
        min_participants=3,
        deadline_mode="adaptive",
        deadline_floor=6.0,
        deadline_cap=40.0,
        deadline_margin=2.0,
    )
    grid = clientapp_grid(config)
    strategy = LensembleStrategy(
        config, run_dir=tmp_path / "run", fraction_evaluate=0.0, warmup_timeout=5.0
    )
    result = strategy.start(
        grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2
    )
    one, two = result.train_metrics_clientapp[1], result.train_metrics_clientapp[2]
    assert one["lensemble.open-deadline"] == one["lensemble.collect-deadline"] == 40.0
    expected = min(40.0, max(6.0, 2.0 * one["lensemble.round-time"]))
    assert two["lensemble.collect-deadline"] == pytest.approx(expected)
    ttls = [(int(m.metadata.group_id), m.metadata.ttl) for m in grid.pushed()]
    assert ttls[:4] == [(1, pytest.approx(80.0 + 5.0, abs=1.0))] * 4  # + the warm-up's grace
    assert ttls[4:] == [(2, pytest.approx(2 * expected))] * 4
    outcomes = result.outcomes
    assert [o.deadlines.mode for o in outcomes if o.deadlines] == ["adaptive"] * 2


def test_the_round_line_prints_counts_as_integers_and_measurements_to_four_places() -> None:
    from lensemble_flwr.coordinator.attempt import RoundOutcome
    from lensemble_flwr.strategies.reporting import report

    outcome = RoundOutcome(
        round=3, attempt=1, state=RoundState.CLOSED, error=None, count=10, contributors=(),
        late=(), rejected=0, global_hash="", diagnostics={}, elapsed=1.0,
        path=(RoundState.OPEN, RoundState.CLOSED),
    )  # fmt: skip
    lines: list[str] = []
    evaluation = MetricRecord({"nodes-beating-local": 7, "global-val-loss": 0.25})
    report(outcome, MetricRecord(), evaluation, [], lines.append)
    assert "C_t=10 " in lines[0]
    assert "nodes-beating-local=7 " in lines[0] and "global-val-loss=0.2500" in lines[0]


def test_fedavgs_reply_line_counts_nodes_with_content_and_nodes_with_errors_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from flwr.app import Error, Metadata

    from lensemble_flwr.strategies.reporting import say_received

    def reply(node: int, error: bool) -> Message:
        metadata = Metadata(
            run_id=1, message_id="", src_node_id=node, dst_node_id=0, reply_to_message_id="m",
            group_id="1", created_at=0.0, ttl=60.0, message_type=MessageType.TRAIN,
        )  # fmt: skip
        if error:
            return Message(Error(code=1, reason="x"), metadata=metadata)  # type: ignore[call-arg]
        return Message(RecordDict(), metadata=metadata)  # type: ignore[call-arg]

    # node 1: content; node 2: an error, then content (counts once, as a result);
    # node 3: errors only (a failure); node 4: content in two exchanges (once)
    replies = [reply(1, False), reply(2, True), reply(2, False), reply(3, True), reply(3, True),
               reply(4, False), reply(4, False)]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="flwr"):
        say_received("aggregate_train", replies)
        say_received("aggregate_evaluate", [])  # nothing, as FedAvg says nothing
    said = [r.getMessage() for r in caplog.records]
    assert said == ["aggregate_train: Received 3 results and 1 failures"]
