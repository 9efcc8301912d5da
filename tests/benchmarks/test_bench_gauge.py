"""The tuning logic of benchmarks/bench_gauge.py: every arm's grid extends past its pick,
the ratio of rounds, and the picks themselves, on made-up loss curves (no federation runs)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from lensemble_flwr.errors import ConfigError

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gauge.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gauge", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_gauge", module)
    spec.loader.exec_module(module)
    return module


def best_near(optimum: float):
    """A pick function over the values run so far: the one nearest ``optimum`` in log."""

    def pick(values: list[float]) -> float:
        return min(values, key=lambda v: abs(math.log(v / optimum)))

    return pick


def search(bench: ModuleType, grid: list[float], optimum: float, **kwargs: Any) -> Any:
    ran: list[float] = []
    nearest = best_near(optimum)
    result = bench.extend_until_interior(
        {"arm": list(grid)},
        lambda arm, value: ran.append(value),
        lambda: {"arm": nearest(grid + ran)},
        **kwargs,
    )
    return result, ran


def test_grid_side(bench: ModuleType) -> None:
    assert bench.grid_side([1, 2, 3], 1) == "low"
    assert bench.grid_side([1, 2, 3], 3) == "high"
    assert bench.grid_side([1, 2, 3], 2) is None
    assert bench.grid_side([2], 2) == "low"  # one value has no neighbour on either side


def test_a_pick_at_the_top_edge_extends_the_grid_until_it_is_inside(bench: ModuleType) -> None:
    # the case: a grid ending at 7e-3 whose best value lies above it
    result, ran = search(bench, [1e-3, 3e-3, 7e-3], optimum=2.5e-2)
    assert ran == pytest.approx([1.4e-2, 2.8e-2, 5.6e-2])
    assert result["picks"]["arm"] == pytest.approx(2.8e-2)
    assert result["grids"]["arm"] == pytest.approx([1e-3, 3e-3, 7e-3, 1.4e-2, 2.8e-2, 5.6e-2])
    assert result["interior"] == {"arm": True}
    assert result["extensions"] == {"arm low": 0, "arm high": 3}


def test_a_pick_at_the_bottom_edge_extends_downwards(bench: ModuleType) -> None:
    result, ran = search(bench, [3e-3, 7e-3, 1.5e-2], optimum=2.5e-3)
    assert ran == pytest.approx([1.5e-3])
    assert result["picks"]["arm"] == 3e-3
    assert result["interior"] == {"arm": True}


def test_an_inside_pick_runs_nothing(bench: ModuleType) -> None:
    result, ran = search(bench, [1e-3, 3e-3, 7e-3], optimum=3e-3)
    assert ran == []
    assert result["interior"] == {"arm": True}


def test_the_bound_stops_the_search_and_says_the_pick_is_at_the_edge(bench: ModuleType) -> None:
    result, ran = search(bench, [1e-3, 3e-3], optimum=10.0, max_steps=2, factor=3.0)
    assert ran == pytest.approx([9e-3, 2.7e-2])
    assert result["picks"]["arm"] == pytest.approx(2.7e-2)
    assert result["interior"] == {"arm": False}


def test_one_arms_new_pick_moves_the_other_arms_and_both_end_inside(bench: ModuleType) -> None:
    # arm b's best value is twice arm a's pick: extending a's grid moves b's pick too
    ran: dict[str, list[float]] = {"a": [], "b": []}
    grids = {"a": [1.0, 2.0, 4.0], "b": [1.0, 2.0, 4.0]}

    def pick() -> dict[str, float]:
        a = best_near(6.0)(grids["a"] + ran["a"])
        return {"a": a, "b": best_near(2 * a)(grids["b"] + ran["b"])}

    result = bench.extend_until_interior(
        grids, lambda arm, value: ran[arm].append(value), pick
    )
    assert result["picks"] == {"a": 8.0, "b": 16.0}
    assert ran == {"a": [8.0, 16.0], "b": [8.0, 16.0, 32.0]}
    assert result["interior"] == {"a": True, "b": True}


@pytest.mark.parametrize(
    ("grids", "kwargs", "field"),
    [
        ({}, {}, "grids"),
        ({"arm": []}, {}, "grids"),
        ({"arm": [0.0, 1e-3]}, {}, "grids"),
        ({"arm": [1e-3, math.nan]}, {}, "grids"),
        ({"arm": [1e-3]}, {"factor": 1.0}, "factor"),
        ({"arm": [1e-3]}, {"max_steps": -1}, "max_steps"),
    ],
)
def test_bad_grids_and_settings_are_refused_before_anything_runs(
    bench: ModuleType, grids: dict[str, list[float]], kwargs: dict[str, Any], field: str
) -> None:
    ran: list[float] = []
    with pytest.raises(ConfigError, match=field):
        bench.extend_until_interior(
            grids, lambda arm, value: ran.append(value), lambda: {"arm": 1e-3}, **kwargs
        )
    assert ran == []


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
