"""The byte language model Flower App without Ray: its ServerApp and ClientApp over a fake
grid, on a tiny configuration (3 nodes, a 2-block model of width 16)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.protocol.messages import MessageKind, kind_of
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.simulations import lm
from lensemble_flwr.simulations.lm_model import ByteLM
from lensemble_flwr.strategies import records
from tests.simulations.test_flower_app import (
    RecordingGrid,
    app_grid,
    forbid_network,
    run_server_app,
    server_context,
)
from tests.strategies.test_grid_transport import (  # noqa: F401  (the autouse fixture sets the ServerApp identity)
    FakeClock,
    FakeGrid,
    _serverapp_identity,
)

NODES = (31, 32, 33)
TINY: dict[str, Any] = {
    "num-server-rounds": 1,
    "num-partitions": 3,
    "fraction-evaluate": 1.0,
    "warmup-timeout": 10.0,
    "data-seed": 0,
    "max-file-bytes": 1024,
    "max-package-bytes": 4096,
    "eval-bytes": 256,
    "d-model": 16,
    "layers": 2,
    "heads": 2,
    "seq-len": 16,
    "lensemble.min-participants": 3,
    "lensemble.deadline-mode": "fixed",
    "lensemble.open-timeout": 30.0,
    "lensemble.collect-timeout": 30.0,
    "lensemble.inner-steps": 8,
    "lensemble.inner-lr": 0.01,
    "lensemble.inner-batch-size": 4,
    "lensemble.weighting": "num-examples",  # as the app's
    "lensemble.require-binding": True,
}


def lm_grid(run_config: dict[str, Any]) -> tuple[FakeGrid, dict[int, Context]]:
    return app_grid(lm.client_app, run_config, NODES)


def run_tiny(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **overrides: Any
) -> tuple[Any, FakeGrid, dict[int, Context], dict[str, Any]]:
    """One ServerApp run of the tiny configuration, with no network connection allowed;
    its result, grid, node contexts and run config."""
    run_config = {**TINY, "run-dir": str(tmp_path), **overrides}

    forbid_network(monkeypatch)
    grid, contexts = lm_grid(run_config)
    result = run_server_app(lm.main, grid, run_config, monkeypatch)
    return result, grid, contexts, run_config


def released_updates(grid: FakeGrid) -> list[dict[str, Any]]:
    return [
        payload
        for _, reply in grid.delivered
        if reply.metadata.message_type == "train"
        for payload in records.decode_reply(reply.content)
        if kind_of(payload) is MessageKind.UPDATE
    ]


def test_a_tiny_lm_trains_a_round_and_prints_bits_per_byte_against_local_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    result, _grid, contexts, run_config = run_tiny(tmp_path, monkeypatch)
    out = capsys.readouterr().out
    held_out = lm.split_packages(lm.corpus_settings(run_config, 3)).held_out
    assert f"round 0, bits per byte: global model on held-out package {held_out!r}" in out
    assert f"round 1, bits per byte: global model on held-out package {held_out!r}" in out
    assert f"node  own files: global  local-only  {held_out!r}: local-only  packages" in out
    assert "final bits per byte (mean over the nodes' held-out files): {" in out
    # the server's number: the held-out package, before and after the round
    server = result.evaluate_metrics_serverapp
    initial, after = server[0]["held-out-package-bpb"], server[1]["held-out-package-bpb"]
    assert math.isfinite(after) and after < 8.0 and after < initial
    # the nodes': the global and the local-only model on each node's held-out files
    evaluation = result.evaluate_metrics_clientapp[1]
    assert set(evaluation) == {
        "global-bpb",
        "local-only-bpb",
        "local-only-held-out-bpb",
        "nodes-beating-local",
    }
    assert all(math.isfinite(v) and v < 8.0 for k, v in evaluation.items() if k.endswith("bpb"))
    split = lm.split_packages(lm.corpus_settings(run_config, 3))
    for node, packages in enumerate(split.nodes):  # one row per node, with its packages
        assert f"  {node:4d}  " in out and "+".join(packages) in out
    assert [r.count for r in verify(Store(tmp_path / "flwr-7"))] == [3]
    # every node keeps its local-only model in its state: a node rebuilt for an evaluate
    # message has it, after the round's 8 steps
    for context in contexts.values():
        training = lm.trainer_fn(context)
        assert training.local_steps == 8
        assert training.local_only is not None
        fresh = ByteLM(training.lm.shape, seed=0)
        trained = training.local_only.model.state_dict()
        assert any(not t.equal(trained[n]) for n, t in fresh.state_dict().items())


def test_int8_releases_train_the_tiny_lm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result, grid, _contexts, _ = run_tiny(tmp_path, monkeypatch, **{"lensemble.quantize": "int8"})
    updates = released_updates(grid)
    assert len(updates) == 3 and all("int8_quantize" in u["transforms"] for u in updates)
    assert [r.count for r in verify(Store(tmp_path / "flwr-7"))] == [3]
    after = result.evaluate_metrics_serverapp[1]["held-out-package-bpb"]
    assert (
        math.isfinite(after)
        and after < result.evaluate_metrics_serverapp[0]["held-out-package-bpb"]
    )


def test_a_masked_round_trains_the_tiny_lm_and_the_nodes_send_no_evaluation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    result, grid, _contexts, _ = run_tiny(
        tmp_path, monkeypatch, **{"lensemble.secagg-threshold": 2}
    )
    updates = released_updates(grid)
    assert len(updates) == 3 and all(u["masked"] and u.get("l2_norm") is None for u in updates)
    assert [r.count for r in verify(Store(tmp_path / "flwr-7"))] == [3]
    after = result.evaluate_metrics_serverapp[1]["held-out-package-bpb"]
    assert (
        math.isfinite(after)
        and after < result.evaluate_metrics_serverapp[0]["held-out-package-bpb"]
    )
    # per-node metrics are not noised: under masking the nodes refuse to evaluate, and
    # the round prints the server's number only
    out = capsys.readouterr().out
    assert "round 1, bits per byte: global model on held-out package" in out
    assert "own files" not in out
    assert not result.evaluate_metrics_clientapp.get(1)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"held-out-package": "no_such_package"}, "held-out-package"),
        ({"num-partitions": 10_000}, "num-partitions"),
        ({"d-model": 10, "heads": 4}, "heads"),
        ({"eval-bytes": 0}, "eval-bytes"),
        ({"validation-fraction": 1.0}, "validation-fraction"),
        ({"local-only": "false"}, "local-only"),  # a string would have read as true
    ],
)
def test_the_lm_serverapp_refuses_a_bad_app_key_before_any_grid_call(
    override: dict[str, Any], key: str
) -> None:
    grid = RecordingGrid()
    with pytest.raises(ConfigError) as raised:
        lm.main(grid, server_context({**TINY, **override}))
    assert raised.value.field == key
    assert grid.calls == []


def test_the_initial_model_is_the_seeds_and_every_node_starts_from_it() -> None:
    shape = lm.model_shape(TINY)
    first, again = lm.initial_params(shape, 3), lm.initial_params(shape, 3)
    assert list(first) == sorted(first)
    assert all(np.array_equal(first[n], again[n]) for n in first)
    other = lm.initial_params(shape, 4)
    assert any(not np.array_equal(first[n], other[n]) for n in first)
