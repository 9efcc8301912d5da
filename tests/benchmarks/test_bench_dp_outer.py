"""benchmarks/bench_dp_outer.py's pick: the best step over every ratio and seed, its outer
lr's grid extended past it, its momentum checked against its grid; on a made-up accuracy
in place of the digits federation."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_dp_outer.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_dp_outer", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(lr: float, momentum: float, *accuracy: float, ratio: float = 0.5) -> dict:
    return {"ratio": ratio, "lr": lr, "momentum": momentum, "accuracy": list(accuracy)}


def test_the_best_step_is_the_best_mean_over_ratios_and_seeds(bench: ModuleType) -> None:
    rows = [
        row(0.7, 0.5, 0.8, 0.8),
        row(0.7, 0.5, 0.4, 0.4, ratio=4),  # mean 0.6 over both ratios
        row(1.0, 0.0, 0.7, 0.7),
        row(1.0, 0.0, 0.7, 0.7, ratio=4),  # mean 0.7
        row(2.0, 0.9, 0.9, math.nan),  # a diverged seed: never picked
        row(0.5, 0.5, 0.7, 0.7),  # ties 1.0's mean: the lower lr wins
        row(0.5, 0.5, 0.7, 0.7, ratio=4),
    ]
    assert bench.best_step(rows) == (0.5, 0.5)


def test_a_momentum_at_an_edge_is_outside_unless_it_is_zero(bench: ModuleType) -> None:
    assert bench.momentum_inside([0.0, 0.5, 0.9], 0.5)
    assert bench.momentum_inside([0.0, 0.5, 0.9], 0.0)  # nothing lies below 0
    assert not bench.momentum_inside([0.0, 0.5, 0.9], 0.9)
    assert not bench.momentum_inside([0.5, 0.9], 0.5)
    assert not bench.momentum_inside([0.0], 0.0)  # nothing tried above it


def fake_arm(best_lr: float, best_momentum: float):
    """A made-up final accuracy, highest at ``best_lr`` and ``best_momentum``; the lrs run."""
    ran: list[float] = []

    def arm(ratio, lr, momentum, seed, rounds, tmp) -> float:
        ran.append(lr)
        return 0.9 - abs(math.log(lr / best_lr)) / 10 - abs(momentum - best_momentum) / 10

    return arm, ran


def test_a_pick_at_the_top_lr_runs_the_next_lr_at_every_ratio_and_momentum(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    arm, ran = fake_arm(best_lr=3.0, best_momentum=0.5)
    monkeypatch.setattr(bench, "arm", arm)
    out = tmp_path / "dp.json"
    bench.main(["--seeds", "0", "--ratios", "0.5,2", "--lrs", "0.7,1", "--momenta",
                "0,0.5,0.9", "--out", str(out)])  # fmt: skip
    # the pick climbs 1 -> 2 -> 4, each time at the top; 8 is worse than 4: 4 is inside
    assert sorted(set(ran)) == [0.7, 1.0, 2.0, 4.0, 8.0]
    assert ran.count(8.0) == 2 * 3  # every ratio x momentum, one seed
    result = json.loads(out.read_text())
    assert result["pick"] == {"lr": 4.0, "momentum": 0.5}
    assert result["grids"]["lr"] == [0.7, 1.0, 2.0, 4.0, 8.0]
    assert result["inside"] == {"outer lr": True, "momentum": True}
    assert "PASS: the picked step has grid values on both sides" in capsys.readouterr().out


def test_the_bound_leaves_the_lr_at_the_edge_and_the_check_fails(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    arm, ran = fake_arm(best_lr=10.0, best_momentum=0.9)
    monkeypatch.setattr(bench, "arm", arm)
    bench.main(["--seeds", "0", "--ratios", "1", "--lrs", "0.7,1", "--momenta", "0,0.9",
                "--max-extensions", "1"])  # fmt: skip
    printed = capsys.readouterr().out
    assert sorted(set(ran)) == [0.7, 1.0, 2.0]
    assert "FAIL: the picked step has grid values on both sides of it; at an edge: " \
        "outer lr, momentum" in printed
