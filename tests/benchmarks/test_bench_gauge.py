"""The tuning logic of benchmarks/bench_gauge.py: the ratio of rounds, the picks and the
edge target, on made-up loss curves (no federation runs). The grid extension itself is
benchmarks/tuning.py's (tests/benchmarks/test_tuning.py)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gauge.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gauge", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_gauge", module)
    spec.loader.exec_module(module)
    return module


def run(curve: list[float]) -> dict[str, Any]:
    return {"loss": curve}


def test_rounds_ratio(bench: ModuleType) -> None:
    diloco = [1.0, 0.5, 0.3, 0.2, 0.2]
    plain = [1.0, 0.8, 0.6, 0.4, 0.3, 0.25, 0.2, 0.1]
    r = bench.rounds_ratio(diloco, plain, rounds=4)
    assert (r["diloco_rounds"], r["plain_rounds"], r["rounds_ratio"]) == (3, 6, 0.5)
    # plain never gets there: the ratio is DiLoCo's rounds over the budget (an upper bound)
    r = bench.rounds_ratio(diloco, [1.0, 0.9, 0.8], rounds=4)
    assert (r["plain_reached"], r["rounds_ratio"]) == (False, 1.5)
    assert math.isnan(bench.rounds_ratio([1.0, math.nan], plain, rounds=1)["rounds_ratio"])


def test_tune_picks_diloco_by_final_loss_and_plain_by_rounds_to_it(bench: ModuleType) -> None:
    diloco = {
        1e-3: {"0": run([1.0, 0.6, 0.4]), "1": run([1.0, 0.6, 0.4])},
        3e-3: {"0": run([1.0, 0.3, 0.2]), "1": run([1.0, 0.4, 0.3])},
        1e-2: {"0": run([1.0, math.nan, math.nan]), "1": run([1.0, 0.1, 0.05])},  # diverged
    }
    plain = {
        1e-3: {"0": run([1.0, 0.9, 0.8, 0.3, 0.2]), "1": run([1.0, 0.9, 0.8, 0.7, 0.6])},
        3e-3: {"0": run([1.0, 0.5, 0.2, 0.1, 0.1]), "1": run([1.0, 0.5, 0.4, 0.3, 0.2])},
        # reaches the targets in as many rounds as 3e-3, ends lower: the tie goes to it
        1e-2: {"0": run([1.0, 0.5, 0.2, 0.1, 0.0]), "1": run([1.0, 0.5, 0.4, 0.3, 0.1])},
    }
    tuned = bench.tune(diloco, plain, rounds=2)
    assert tuned["diloco_inner_lr"] == 3e-3  # 1e-2's mean is NaN: it sorts last
    assert tuned["plain_rounds_to_target"][1e-3] == [4.0, math.inf]
    assert tuned["plain_inner_lr"] == 1e-2
    assert tuned["per_seed"]["0"]["rounds_ratio"] == 1.0
    assert tuned["per_seed"]["1"]["rounds_ratio"] == pytest.approx(2 / 3)


def test_the_edge_target_fails_when_a_pick_stayed_at_an_edge(bench: ModuleType) -> None:
    seed = {
        "aligned_over_control": 1.0,
        "unaligned_over_control": 3.0,
        "rounds_ratio": 0.4,
        "plain_reached": True,
        "aborted_attempts": 0,
        "stopped": {},
    }
    tuned = {
        "tune_seeds": [0],
        "diloco_inner_lr": 1e-2,
        "plain_inner_lr": 3e-2,
        "interior": {"control": True, "plain-averaging": False},
    }
    checks = bench.verdicts({5: seed}, tuned, {"5": {"rounds_ratio": 0.6, "plain_reached": True}})
    by_target = {c["target"]: c for c in checks}
    edge = by_target["every tuned inner lr has grid values on both sides of it"]
    assert (edge["pass"], edge["value"]) == (False, 1)
    assert "plain-averaging" in edge["measure"]
    rounds = next(c for c in checks if c["target"].startswith("DiLoCo"))
    assert (rounds["value"], rounds["pass"]) == (0.6, False)  # the held-out seed's ratio
    tuned["interior"]["plain-averaging"] = True
    checks = bench.verdicts({5: seed}, tuned, {"5": {"rounds_ratio": 0.4, "plain_reached": True}})
    assert all(c["pass"] for c in checks)


def test_tuning_and_evaluation_seeds_must_not_overlap(bench: ModuleType) -> None:
    with pytest.raises(SystemExit):
        bench.parse(["--seeds", "0", "5", "--tune-seeds", "0", "1"])
    assert bench.parse(["--seeds", "0", "--tune-seeds", "0", "--tune-lrs"]).tune_lrs == []
    assert bench.parse(["--seeds", "5", "--tune-seeds", "0"]).seeds == [5]


def test_the_gauge_tunes_with_the_shared_grid_extension(bench: ModuleType) -> None:
    import tuning

    assert bench.extend_until_interior is tuning.extend_until_interior
