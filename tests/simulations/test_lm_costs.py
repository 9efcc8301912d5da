"""The core of ``benchmarks/bench_lm_costs.py`` on a tiny byte LM (3 nodes, 2 rounds, a
2-block model of width 16): each arm runs as what it says it measures (int8 releases,
masked rounds, both), and each round's time splits into parts that add up."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_lm_costs as bench

NODES, ROUNDS = 3, 2
TINY_APP: dict[str, Any] = {
    "data-seed": 0,
    "validation-fraction": 0.2,
    "max-file-bytes": 1024,
    "max-package-bytes": 4096,
    "d-model": 16,
    "layers": 2,
    "heads": 2,
    "seq-len": 16,
    "warmup-timeout": 10.0,
    "lensemble.inner-lr": 0.01,
    "lensemble.inner-batch-size": 4,
    "lensemble.weighting": "num-examples",
    "lensemble.require-binding": True,
    "lensemble.shared-groups": "*",
    "lensemble.local-groups": "",
}


@pytest.fixture(scope="module")
def arms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every arm of the benchmark, once, on the tiny configuration."""
    with pytest.MonkeyPatch.context() as patch:  # a ServerApp's identity, as Flower sets it
        patch.setattr(TaskIdentity, "_run_id", 1)
        patch.setattr(TaskIdentity, "_node_id", SUPERLINK_NODE_ID)
        patch.setattr(TaskIdentity, "_task_id", 1)
        base = bench.lm_run_config(
            TINY_APP, nodes=NODES, rounds=ROUNDS, inner_steps=4, seed=0, eval_bytes=256
        )
        run_dir = tmp_path_factory.mktemp("lm-costs")
        return {
            arm: bench.run_arm(base, arm, nodes=NODES, threshold=2, run_id=k + 1, run_dir=run_dir)
            for k, arm in enumerate(bench.ARMS)
        }


@pytest.mark.parametrize("arm", bench.ARMS)
def test_each_arm_releases_what_it_says(arms: dict[str, dict[str, Any]], arm: str) -> None:
    result = arms[arm]
    assert result["ledger_counts"] == [NODES] * ROUNDS  # verified, every node every round
    updates = result["updates"]
    assert len(updates) == NODES * ROUNDS
    int8, masked = "int8" in arm, "masked" in arm
    assert all(("int8_quantize" in u["transforms"]) is int8 for u in updates)
    assert all(u["masked"] is masked for u in updates)
    dtype = "int64" if masked else "int8" if int8 else "float32"
    assert all(u["dtypes"] == [dtype] for u in updates)
    # the coordinator's side: the outer step took a revealed masked sum in masked rounds
    assert result["secure_sum"] == [masked] * ROUNDS
    assert [m["exchanges"] for m in result["round_metrics"]] == [2.0 if masked else 1.0] * ROUNDS


def test_int8_shrinks_the_upload_and_masking_grows_it(arms: dict[str, dict[str, Any]]) -> None:
    upload = {
        arm: bench.summarize(a, NODES)["upload_bytes_per_participant"] for arm, a in arms.items()
    }
    assert upload["int8"] < 0.5 * upload["plaintext"]
    assert upload["masked"] > 1.5 * upload["plaintext"]
    assert upload["int8+masked"] > 1.5 * upload["plaintext"]  # masked as int64 all the same


def test_masked_rounds_give_the_plaintext_model(arms: dict[str, dict[str, Any]]) -> None:
    plain, masked = arms["plaintext"]["final"], arms["masked"]["final"]
    assert masked["held_out_package"] == pytest.approx(plain["held_out_package"], abs=1e-4)
    assert masked["nodes"] == pytest.approx(plain["nodes"], abs=1e-4)
    assert all(math.isfinite(v) and v < 8.5 for v in plain["nodes"])


@pytest.mark.parametrize("arm", bench.ARMS)
def test_every_rounds_time_splits_into_parts_that_add_up(
    arms: dict[str, dict[str, Any]], arm: str
) -> None:
    result = arms[arm]
    rounds = result["rounds"]
    assert [r["round"] for r in rounds] == [float(r) for r in range(1, ROUNDS + 1)]
    assert result["fits"] == NODES * ROUNDS
    for r in rounds:
        assert r["training"] > 0 and r["participant_other"] > 0 and r["coordinator"] > 0
        parts = r["training"] + r["participant_other"] + r["coordinator"]
        assert parts == pytest.approx(r["wall"], rel=1e-9)
        assert r["coordinator_share"] == pytest.approx(r["coordinator"] / r["wall"])
        # the process's CPU in the round less the ClientApp calls' (a part of it)
        assert r["coordinator_cpu"] >= -0.01 and r["training_cpu"] > 0
    assert sum(r["wall"] for r in rounds) <= result["run_seconds"]
    summary = bench.summarize(result, NODES)
    assert summary["node_training_per_round"] == pytest.approx(
        sum(r["training"] for r in rounds) / ROUNDS / NODES
    )


def scripted_log() -> bench.Log:
    """Two rounds: round 1 from t = 0 to 10, round 2 from 10 to the end at 16."""
    log = bench.Log(round_starts={1: 0.0, 2: 10.0}, round_cpu={1: 0.0, 2: 8.0})
    log.calls = [
        bench.Call(1, "1", "train", 1.0, 4.0, cpu=3.0),
        bench.Call(2, "1", "train", 4.0, 8.0, cpu=4.0),
        bench.Call(1, "2", "train", 10.5, 12.5, cpu=2.0),
        bench.Call(2, "2", "train", 12.5, 14.5, cpu=2.0),
    ]
    log.fits = [(1.5, 3.5), (4.5, 7.5), (11.0, 12.0), (13.0, 14.0)]
    log.fit_cpu = [(1.5, 2.0), (4.5, 2.0), (11.0, 0.5), (13.0, 0.5)]
    log.bench = [(8.0, 8.5)]  # the benchmark's own half second, in round 1
    return log


def test_the_split_of_a_scripted_run() -> None:
    first, second = bench.round_split(scripted_log(), end=16.0, end_cpu=13.0, nodes=2)
    assert first["wall"] == 9.5 and second["wall"] == 6.0
    assert (first["training"], first["participant_other"], first["coordinator"]) == (5.0, 2.0, 2.5)
    assert (second["training"], second["participant_other"], second["coordinator"]) == (
        2.0,
        2.0,
        2.0,
    )
    assert first["coordinator_cpu"] == 1.0 and second["coordinator_cpu"] == 1.0
    assert (first["training_cpu"], second["training_cpu"]) == (4.0, 1.0)
    assert first["coord_cpu_per_node_training_cpu"] == 1.0 / 2.0
    assert second["coord_cpu_per_node_training_cpu"] == 1.0 / 0.5
    assert first["coord_per_node_training"] == 2.5 / 2.5
    assert second["coord_per_node_training"] == 2.0 / 1.0


def test_a_log_the_split_cannot_read_is_refused() -> None:
    log = scripted_log()
    with pytest.raises(ValueError, match="before its last round started"):
        bench.round_split(log, end=9.0, end_cpu=13.0, nodes=2)
    del log.round_starts[1]
    with pytest.raises(ValueError, match=r"expected 1\.\.R"):
        bench.round_split(log, end=16.0, end_cpu=13.0, nodes=2)
    with pytest.raises(ValueError, match=r"expected 1\.\.R"):
        bench.round_split(bench.Log(), end=16.0, end_cpu=13.0, nodes=2)


def test_an_unknown_arm_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown arm"):
        bench.arm_keys("fp16", 2)
    assert bench.arm_keys("int8+masked", 3) == {
        "lensemble.quantize": "int8",
        "lensemble.secagg-threshold": 3,
    }
