"""The digits Flower App without Ray: its ServerApp and ClientApp over a fake grid, on a
tiny federation (3 nodes, 2 rounds), with each node's local-only model beside the
federated one."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, RecordDict

from lensemble_flwr.clients.state import load_state
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.participant.participant import training_state
from lensemble_flwr.simulations import digits
from lensemble_flwr.simulations.digits_data import DigitsNet, DigitsTrainer, load_partition
from lensemble_flwr.simulations.local_only import LOCAL_ONLY
from tests.simulations.test_flower_app import app_grid, forbid_network, run_server_app
from tests.strategies.test_grid_transport import (  # noqa: F401  (the autouse fixture sets the ServerApp identity)
    FakeClock,
    FakeGrid,
    _serverapp_identity,
)

NODES = (41, 42, 43)
STEPS, ROUNDS = 8, 2
TINY: dict[str, Any] = {
    "num-server-rounds": ROUNDS,
    "num-partitions": 3,
    "fraction-evaluate": 1.0,
    "warmup-timeout": 10.0,
    "data-seed": 0,
    "model": "net",
    "lensemble.min-participants": 3,
    "lensemble.deadline-mode": "fixed",
    "lensemble.open-timeout": 30.0,
    "lensemble.collect-timeout": 30.0,
    "lensemble.inner-steps": STEPS,
    "lensemble.inner-lr": 0.01,
    "lensemble.inner-batch-size": 16,
}
BOTH = {
    "global-accuracy",
    "global-loss",
    "local-only-accuracy",
    "local-only-loss",
    "nodes-beating-local",
}
DP = {
    "model": "linear",
    "lensemble.clip-norm": 1.0,
    "lensemble.noise-multiplier": 2.0,  # two rounds spend epsilon 7.08
    "lensemble.dp-epsilon": 10.0,
}


def run_tiny(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **overrides: Any
) -> tuple[Any, FakeGrid, dict[int, Context]]:
    """One ServerApp run of the tiny federation, with no network connection allowed: its
    result, grid and node contexts."""
    run_config = {**TINY, "run-dir": str(tmp_path / "runs"), **overrides}

    forbid_network(monkeypatch)
    budgets = {"dp-budget-dir": str(tmp_path / "budgets")}
    grid, contexts = app_grid(digits.client_app, run_config, NODES, budgets)
    result = run_server_app(digits.main, grid, run_config, monkeypatch)
    return result, grid, contexts


def sent_metrics(grid: FakeGrid, server_round: int) -> list[Any]:
    """The metrics of the nodes' evaluate replies of ``server_round``."""
    return [
        reply.content.metric_records["metrics"]
        for instruction, reply in grid.delivered
        if reply.metadata.message_type == "evaluate"
        and instruction.content.config_records["config"]["server-round"] == server_round
    ]


def blobs(content: RecordDict) -> Iterator[bytes]:
    """Every name, array and byte or text value in ``content``."""
    for name, record in content.items():
        yield name.encode()
        if isinstance(record, ArrayRecord):
            for key, array in record.items():
                yield key.encode()
                yield array.numpy().tobytes()
            continue
        for key, value in record.items():
            yield key.encode()
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, bytes):
                    yield item
                elif isinstance(item, str):
                    yield item.encode()


def test_each_node_reports_the_global_and_its_local_only_model_on_its_test_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    result, grid, contexts = run_tiny(tmp_path, monkeypatch)
    out = capsys.readouterr().out
    evaluation = result.evaluate_metrics_clientapp[ROUNDS]
    assert set(evaluation) == BOTH
    beating = evaluation["nodes-beating-local"]
    assert isinstance(beating, int) and 0 <= beating <= 3
    # every node's reply: both models on its own test split, as its saved state has them
    final = result.arrays.to_numpy_ndarrays()
    names = sorted(DigitsNet().state_dict())
    sent_by = {int(m["node"]): m for m in sent_metrics(grid, ROUNDS)}
    assert sorted(sent_by) == [0, 1, 2]
    for i, context in enumerate(contexts.values()):
        sent = sent_by[i]
        training = digits.trainer_fn(context)  # rebuilt from the node's state
        assert training.local_steps == ROUNDS * STEPS
        kept = training_state(load_state(context.state)).arrays
        prefix = f"{LOCAL_ONLY}model/"
        local = {k[len(prefix) :]: v for k, v in kept.items() if k.startswith(prefix)}
        assert sorted(local) == names
        loss, accuracy, count = training.digits.evaluate(local)
        assert (sent["local-only-loss"], sent["local-only-accuracy"]) == (loss, accuracy)
        assert sent["num-examples"] == count == len(training.digits.partition.y_test) > 0
        g_loss, g_accuracy, _ = training.digits.evaluate(dict(zip(names, final, strict=True)))
        assert (sent["global-loss"], sent["global-accuracy"]) == (g_loss, g_accuracy)
        assert math.isfinite(loss) and loss != g_loss  # two different models
    for key in BOTH - {"nodes-beating-local"}:  # each node counts once
        assert evaluation[key] == pytest.approx(np.mean([m[key] for m in sent_by.values()]))
    wins = [m["global-accuracy"] > m["local-only-accuracy"] for m in sent_by.values()]
    assert beating == sum(wins)
    # the per-node table of the last round, one row per node, and the count it sums to
    head = "node  test examples  global acc  local-only acc  global loss  local-only loss"
    table = out[out.index(head) :].splitlines()
    assert [row.split()[0] for row in table[1:4]] == ["0", "1", "2"]
    assert [row.split()[-1] for row in table[1:4]] == ["yes" if w else "no" for w in wins]
    assert table[4] == (
        f"the global model beats local-only on {beating} of 3 nodes "
        "(a higher accuracy on the node's own test split)"
    )


def test_the_local_only_model_never_leaves_its_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _result, grid, contexts = run_tiny(tmp_path, monkeypatch)
    sent = [
        blob
        for instruction, reply in grid.delivered
        for blob in (*blobs(instruction.content), *blobs(reply.content))
    ]
    assert sent and not any(LOCAL_ONLY.encode() in blob for blob in sent)
    arrays = [
        np.asarray(array.numpy(), dtype=np.float64)
        for instruction, reply in grid.delivered
        for content in (instruction.content, reply.content)
        for record in content.array_records.values()
        for array in record.values()
    ]
    for context in contexts.values():
        model = digits.trainer_fn(context).local_only.model  # type: ignore[union-attr]
        # nor as an update: the local-only weights, or their difference from any model a
        # message carries (a broadcast global model), are not what any array is
        for tensor in model.state_dict().values():
            weights = tensor.numpy().astype(np.float64)
            same = [a for a in arrays if a.shape == weights.shape]
            derived = [weights, *(weights - a for a in same), *(a - weights for a in same)]
            assert same and not any(np.allclose(a, d, atol=1e-6) for a in same for d in derived)
        # the first 16 weights of each tensor, as float32 bytes: in no message ...
        needles = [t.numpy().astype("<f4").tobytes()[:64] for t in model.state_dict().values()]
        assert not any(needle in blob for needle in needles for blob in sent)
        # ... though the node's own state, where it is kept, has every one
        kept = list(blobs(context.state))
        assert all(any(needle in blob for blob in kept) for needle in needles)


def test_local_only_false_trains_and_reports_no_local_only_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    result, _grid, contexts = run_tiny(tmp_path, monkeypatch, **{"local-only": False})
    out = capsys.readouterr().out
    assert set(result.evaluate_metrics_clientapp[ROUNDS]) == {"global-accuracy", "global-loss"}
    assert "nodes-beating-local" not in out and "beats local-only" not in out
    assert "node  test examples  global acc" in out  # the table, with no local-only column values
    for context in contexts.values():
        training = digits.trainer_fn(context)
        assert training.local_only is None and training.local_only_evaluate() is None
        assert not any(name.startswith(LOCAL_ONLY) for name in load_state(context.state).arrays)


def test_under_dp_the_nodes_send_no_per_node_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    result, grid, contexts = run_tiny(tmp_path, monkeypatch, **DP)
    out = capsys.readouterr().out
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2]  # the server's own
    assert not any(result.evaluate_metrics_clientapp.values())
    # the strategy asks no node to evaluate ...
    assert [i.metadata.message_type for i, _ in grid.delivered] == ["train"] * 3 * ROUNDS
    assert "node  test examples" not in out and "beats local-only" not in out
    # ... and a node asked all the same refuses, where a run without DP gets both models
    context = contexts[NODES[0]]
    assert digits.trainer_fn(context).local_steps == ROUNDS * STEPS  # trained, unsent
    refused = digits.client_app(evaluate_message(result.arrays), context)
    assert refused.has_error() and "metrics are not released" in refused.error.reason
    plain = Context(
        run_id=1,
        node_id=NODES[0],
        node_config=dict(context.node_config),
        state=context.state,
        run_config={**TINY, "model": "linear"},
    )
    answered = digits.client_app(evaluate_message(result.arrays), plain)
    assert not answered.has_error()
    assert BOTH - {"nodes-beating-local"} <= set(answered.content.metric_records["metrics"])


def evaluate_message(arrays: ArrayRecord) -> Message:
    message = Message(RecordDict({"arrays": arrays}), NODES[0], "evaluate")
    message.metadata.__dict__["_message_id"] = "evaluate-1"
    return message


def test_the_local_only_model_takes_the_same_batches_and_never_the_global_model() -> None:
    config = LensembleConfig.from_run_config(TINY)
    trainer = DigitsTrainer(load_partition(1, 3))
    training = digits.DigitsTraining(trainer, config)
    start = {n: t.numpy().copy() for n, t in DigitsNet().state_dict().items()}
    shared = training.fit(start, steps=STEPS, seed=5)
    local = training.local_only.model.state_dict()  # type: ignore[union-attr]
    # from the same start on the same batches: round 1's local-only model is the node's
    # trained model
    assert all(np.allclose(shared[n], local[n].numpy(), atol=1e-6) for n in shared)
    moved = {n: v + 0.5 for n, v in start.items()}
    training.fit(moved, steps=STEPS, seed=6)
    after = training.local_only.model.state_dict()  # type: ignore[union-attr]
    assert all(np.abs(after[n].numpy() - moved[n]).max() > 0.1 for n in after)
    assert training.local_steps == 2 * STEPS


def test_a_local_only_that_is_not_a_boolean_is_refused_before_any_grid_call() -> None:
    from tests.simulations.test_flower_app import (
        RecordingGrid,
        server_context,
    )

    grid = RecordingGrid()
    with pytest.raises(ConfigError, match="local-only: must be true or false, got 'false'"):
        digits.main(grid, server_context({**TINY, "local-only": "false"}))
    assert grid.calls == []
    node = Context(
        run_id=1,
        node_id=NODES[0],
        node_config={"partition-id": 0, "num-partitions": 3},
        state=RecordDict(),
        run_config={**TINY, "local-only": 0},
    )
    with pytest.raises(ConfigError, match="local-only: must be true or false, got 0"):
        digits.trainer_fn(node)
    assert digits.trainer_fn(Context(**{**vars(node), "run_config": TINY})).local_only is not None
