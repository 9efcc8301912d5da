"""The world-model Flower App without Ray: its ServerApp and ClientApp over a fake grid."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, MetricRecord, RecordDict

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.protocol.messages import MessageKind, kind_of
from lensemble_flwr.provenance.round_metrics import read_round_metrics
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.simulations import flower_app, world
from lensemble_flwr.simulations.world_baseline_cache import tuned_local_only_result
from lensemble_flwr.simulations.world_federation import world_gauge
from lensemble_flwr.simulations.world_model import initial_params, random_orthogonal
from lensemble_flwr.simulations.world_tuning import Stopping
from lensemble_flwr.strategies import records
from tests.simulations.test_flower_app import app_grid, run_server_app
from tests.strategies.test_grid_transport import (  # noqa: F401  (the autouse fixture sets the ServerApp identity)
    FakeClock,
    FakeGrid,
    _serverapp_identity,
)

NODES = (21, 22, 23)
RUN_CONFIG: dict[str, Any] = {
    "num-server-rounds": 2,
    "num-partitions": 3,
    "fraction-evaluate": 1.0,
    "warmup-timeout": 10.0,
    "rotate-start": True,
    "lensemble.min-participants": 3,
    "lensemble.open-timeout": 30.0,
    "lensemble.collect-timeout": 30.0,
    "lensemble.inner-steps": 5,
    "lensemble.inner-lr": 0.003,
    "lensemble.inner-weight-decay": 0.0,
    "lensemble.shared-groups": "encoder,predictor",
    "lensemble.local-groups": "action_head",
    "lensemble.gauge-align": True,
}


def world_grid(run_config: dict[str, Any]) -> tuple[FakeGrid, dict[int, Context]]:
    return app_grid(world.client_app, run_config, NODES)


def test_the_world_app_aligns_trains_and_evaluates_with_local_heads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_config = {**RUN_CONFIG, "run-dir": str(tmp_path), "baseline-cache": str(tmp_path / "c")}
    grid, contexts = world_grid(run_config)
    tuned: list[int] = []

    def quick_baseline(index: int, *args: Any, **kwargs: Any) -> dict[str, float]:
        tuned.append(index)  # a short stopping rule: the test's seconds
        quick = Stopping(every=5, patience=1, max_steps=10)
        return tuned_local_only_result(index, *args, **kwargs, stopping=quick)

    monkeypatch.setattr(world, "tuned_local_only_result", quick_baseline)
    result = run_server_app(world.main, grid, run_config, monkeypatch)
    out = capsys.readouterr().out
    assert "final losses (mean over nodes, global model with each node's own head): {" in out
    # every round's evaluation: the global model on each node's training and validation
    # data, and on the scoring half of its validation data beside the node's tuned
    # local-only baseline there; then a per-node table
    evaluation = result.evaluate_metrics_clientapp
    assert sorted(evaluation) == [1, 2]
    for metrics in evaluation.values():
        assert set(metrics) == {
            "global-train-loss",
            "global-val-loss",
            "global-held-out-loss",
            "local-only-held-out-loss",
            "nodes-beating-local",
        }
        assert 0 <= metrics["nodes-beating-local"] <= 3
    header = "global-val-loss  global-held-out-loss  local-only-held-out-loss  federated better"
    assert header in out
    assert len(list((tmp_path / "c" / "world-local-only").glob("*.json"))) == 3  # one per node
    assert sorted(set(tuned)) == [0, 1, 2]  # the baseline is the tuned one
    # the baseline does not depend on the round: the same in every round
    assert evaluation[1]["local-only-held-out-loss"] == evaluation[2]["local-only-held-out-loss"]
    assert evaluation[1]["global-held-out-loss"] != evaluation[2]["global-held-out-loss"]
    # the strategy keeps the round's metrics for `lensemble-flwr report`'s curves
    kept = read_round_metrics(tmp_path / "flwr-7")
    assert sorted(kept) == [0, 1, 2] and "global-val-loss" in kept[2]["evaluate"]
    assert "last-batch-loss" in kept[2]["train"]
    # the server evaluates the probe moment gap of the initial and every committed model
    gaps = result.evaluate_metrics_serverapp
    assert sorted(gaps) == [0, 1, 2]
    assert all(
        math.isfinite(m["probe-moment-gap"]) and m["probe-moment-gap"] >= 0 for m in gaps.values()
    )
    # and keeps them too, round 0 (the initial model) included
    assert {r: kept[r]["server"] for r in kept} == {r: dict(m) for r, m in gaps.items()}
    ledger = verify(Store(tmp_path / "flwr-7"))
    assert [r.count for r in ledger] == [3, 3]
    assert all(r.frame_drift is not None and 0 <= r.frame_drift <= 1 for r in ledger)
    # every update was aligned before it was differenced, on the round's sketch
    updates = [
        payload
        for _, reply in grid.delivered
        if reply.metadata.message_type == "train"
        for payload in records.decode_reply(reply.content)
        if kind_of(payload) is MessageKind.UPDATE
    ]
    assert len(updates) == 6
    assert all(tuple(u["transforms"])[:2] == ("align", "difference") for u in updates)
    assert all(u["sketch_fingerprint"] for u in updates)
    # each node keeps its own trained action head (its own action dimension) in its state,
    # and a node rebuilt for an evaluate message gets it back
    for context in contexts.values():
        fresh = Context(
            run_id=1,
            node_id=context.node_id,
            node_config=context.node_config,
            state=RecordDict(),
            run_config=run_config,
        )
        kept = world.trainer_fn(context).trainer.model.action_head.weight.detach()
        initial = world.trainer_fn(fresh).trainer.model.action_head.weight.detach()
        assert kept.shape == initial.shape and not kept.equal(initial)
    dims = {world.trainer_fn(c).trainer.data.embodiment.action_dim for c in contexts.values()}
    assert dims == {4, 5, 6}  # the main job's world: actuation 'full'


@pytest.mark.parametrize(
    ("groups", "key"),
    [
        ({"shared-groups": "*", "local-groups": ""}, "local-groups"),
        ({"shared-groups": "encoder", "local-groups": "action_head"}, "shared-groups"),
    ],
)
def test_the_world_app_refuses_groups_that_would_share_action_heads(
    groups: dict[str, str], key: str
) -> None:
    with pytest.raises(ConfigError, match=f"^{key}"):
        world.check_groups(LensembleConfig.from_flat(groups))


def test_a_baseline_needs_two_validation_trajectories(tmp_path: Path) -> None:
    def server(run_config: dict[str, Any]) -> Context:
        return Context(
            run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config=run_config
        )

    run_config = {**RUN_CONFIG, "run-dir": str(tmp_path), "validation-trajectories": 1}
    grid, _ = world_grid(run_config)
    with pytest.raises(ConfigError, match=r"^validation-trajectories"):
        world.main(grid, server(run_config))
    assert grid.delivered == []  # refused before anything was asked of a node
    world.check_baseline_split(server({**run_config, "baseline-cache": "off"}))  # no baseline


def test_probe_moment_gap_by_hand() -> None:
    gauge, params = world_gauge(0), initial_params(0)
    d = gauge.adapter.latent_dim
    silent = {
        **params,
        "encoder.out.weight": np.zeros_like(params["encoder.out.weight"]),
        "encoder.out.bias": np.zeros_like(params["encoder.out.bias"]),
    }
    assert world.probe_moment_gap(gauge, silent) == pytest.approx(1.0)  # ||0 - I||² / d
    one_axis = {**silent, "encoder.out.bias": np.eye(d, dtype=np.float32)[0]}
    assert world.probe_moment_gap(gauge, one_axis) == pytest.approx((d - 1) / d)  # z = e1
    # frame-invariant: the same network in another frame has the same gap
    rotated = gauge.adapter.rotate(params, random_orthogonal(d, seed=3))
    assert world.probe_moment_gap(gauge, rotated) == pytest.approx(
        world.probe_moment_gap(gauge, params), rel=1e-5
    )


def test_the_final_report_reads_the_latest_round_and_survives_none() -> None:
    assert flower_app.last_metrics({}) is None  # no round evaluated
    by_round = {0: MetricRecord({"loss": 2.0}), 2: MetricRecord({"loss": 0.5})}
    assert flower_app.last_metrics(by_round) == {"loss": 0.5}
    assert flower_app.last_metrics({**by_round, 3: MetricRecord({})}) is None
