"""benchmarks/bench_learning.py's tuning: every arm's inner and server grids extend past
their picks, on made-up score functions (no federation runs)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

from lensemble_flwr.errors import ConfigError

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_learning.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    if "bench_learning" in sys.modules:
        return sys.modules["bench_learning"]
    spec = importlib.util.spec_from_file_location("bench_learning", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_learning"] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def peaked(inner: float, server: float | None):
    """A score (a made-up final accuracy) highest at ``inner`` and ``server``, falling
    with the log distance from them; records every setting it is asked for."""
    asked: list = []

    def score(setting) -> float:
        if setting not in asked:
            asked.append(setting)
        gap = math.log(setting.inner_lr / inner) ** 2
        if server is not None and setting.server_lr is not None:
            gap += math.log(setting.server_lr / server) ** 2
        return (1.0 - gap,)

    return score, asked


def test_a_pick_at_the_top_of_the_inner_grid_adds_the_next_rate_at_every_server_rate(
    bench: ModuleType,
) -> None:
    score, asked = peaked(inner=0.1, server=0.3)
    tuned = bench.tune_arms(
        [1e-2, 3e-2], {"lensemble": [0.1, 0.3, 1.0]}, score, factor=3.0, max_steps=3
    )
    assert tuned["grids"]["lensemble inner"] == pytest.approx([1e-2, 3e-2, 9e-2, 0.27])
    assert tuned["picks"]["lensemble inner"] == pytest.approx(9e-2)
    assert tuned["picks"]["lensemble server"] == 0.3
    assert tuned["interior"] == {"lensemble inner": True, "lensemble server": True}
    assert tuned["extensions"]["lensemble inner high"] == 2
    # every inner rate was run with every server rate: the grid stays a full product
    assert len(asked) == 4 * 3
    chosen = tuned["selected"]["lensemble"]
    assert (chosen.arm, chosen.inner_lr, chosen.server_lr) == ("lensemble", tuned["picks"][
        "lensemble inner"], 0.3)


def test_a_server_pick_at_the_bottom_extends_downwards_and_fedavg_has_no_server_grid(
    bench: ModuleType,
) -> None:
    score, asked = peaked(inner=3e-2, server=0.1)
    tuned = bench.tune_arms(
        [1e-2, 3e-2, 1e-1],
        {"FedAvg": None, "FedAvgM": [0.3, 1.0]},
        score,
        factor=3.0,
        max_steps=3,
    )
    assert tuned["grids"]["FedAvgM server"] == pytest.approx([0.1 / 3, 0.1, 0.3, 1.0])
    assert tuned["picks"]["FedAvgM server"] == pytest.approx(0.1)
    assert "FedAvg server" not in tuned["grids"]
    assert tuned["picks"]["FedAvg inner"] == 3e-2
    assert all(tuned["interior"].values())
    fedavg = [s for s in asked if s.arm == "FedAvg"]
    assert [s.server_lr for s in fedavg] == [None, None, None]
    assert bench.edge_verdict(tuned, "by accuracy").startswith("PASS")


def test_the_bound_leaves_a_pick_at_the_edge_and_the_edge_target_fails(
    bench: ModuleType,
) -> None:
    score, _ = peaked(inner=10.0, server=0.3)
    tuned = bench.tune_arms(
        [1e-2, 3e-2], {"FedAdam": [0.1, 0.3, 1.0]}, score, factor=3.0, max_steps=1
    )
    assert tuned["grids"]["FedAdam inner"] == pytest.approx([1e-2, 3e-2, 9e-2])
    assert tuned["interior"] == {"FedAdam inner": False, "FedAdam server": True}
    line = bench.edge_verdict(tuned, "by accuracy")
    assert line.startswith("FAIL") and "FedAdam inner" in line


def test_a_diverged_setting_is_never_picked(bench: ModuleType) -> None:
    def score(setting) -> float:  # the highest inner rate diverged: NaN accuracy
        return (math.nan if setting.inner_lr > 0.05 else setting.inner_lr,)

    tuned = bench.tune_arms([1e-2, 3e-2, 1e-1], {"FedAvg": None}, score, factor=3.0, max_steps=3)
    assert tuned["picks"]["FedAvg inner"] == 3e-2
    assert tuned["interior"] == {"FedAvg inner": True}


@pytest.mark.parametrize(
    ("inner", "server"),
    [([], {"FedAvg": None}), ([0.0, 1e-2], {"FedAvg": None}), ([1e-2], {"FedAvgM": []})],
)
def test_a_bad_grid_is_refused_before_anything_runs(
    bench: ModuleType, inner: list[float], server: dict
) -> None:
    score, asked = peaked(inner=1e-2, server=0.3)
    with pytest.raises(ConfigError, match="grids"):
        bench.tune_arms(inner, server, score, factor=3.0, max_steps=3)
    assert asked == []


def test_the_default_grids_cover_every_arm_and_quick_keeps_the_extension(
    bench: ModuleType,
) -> None:
    args = bench.parse([])
    assert bench.server_grids(args) == {
        "FedAvg": None,
        "FedAvgM": [0.1, 0.3, 1.0],
        "FedAdam": [0.03, 0.1, 0.3],
        "lensemble": [0.1, 0.3, 0.7],
    }
    assert (args.extend_factor, args.max_extensions) == (3.0, 3)
    assert bench.parse(["--arms", "FedAvg", "--quick"]).inner_lrs == [1e-2, 3e-2]


def test_rounds_score_prefers_fewer_rounds_then_accuracy(bench: ModuleType) -> None:
    def entry(rounds: float | None, accuracy: float) -> dict:
        return {"median_rounds_to_target": rounds, "final_accuracy": {"mean": accuracy}}

    assert bench.rounds_score(entry(4, 0.9)) == (-4.0, 0.9)
    ranked = sorted([entry(None, 0.8), entry(5, 0.9), entry(4, 0.5), entry(5, 0.95),
                     entry(math.inf, 0.85)], key=bench.rounds_score, reverse=True)  # fmt: skip
    assert [(e["median_rounds_to_target"], e["final_accuracy"]["mean"]) for e in ranked] == [
        (4, 0.5), (5, 0.95), (5, 0.9), (math.inf, 0.85), (None, 0.8)
    ]


def fake_runs(best_inner: float, best_server: float):
    """In place of a federation: accuracy curves that rise faster and end higher the
    nearer a setting is to the best rates; the settings run, in order."""
    ran: list = []

    def run_setting(setting, seed, args) -> dict[str, list[float]]:
        if seed == 0:
            ran.append(setting)
        gap = abs(math.log(setting.inner_lr / best_inner))
        if setting.server_lr is not None:
            gap += abs(math.log(setting.server_lr / best_server))
        top = 0.99 - gap / 30 + seed / 1000
        accuracy = [top * (1 - 0.5 ** (r / (0.5 + gap))) for r in range(1, args.rounds + 1)]
        return {"accuracy": accuracy, "loss": [1 - a for a in accuracy]}

    return run_setting, ran


def test_main_extends_both_selections_past_their_picks_and_reuse_runs_only_what_is_new(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    run_setting, ran = fake_runs(best_inner=0.3, best_server=0.3)
    monkeypatch.setattr(bench, "run_setting", run_setting)
    out = tmp_path / "learning.json"
    argv = ["--arms", "FedAvg", "lensemble", "--seeds", "2", "--rounds", "12", "--inner-lrs",
            "0.01", "0.03", "--outer-lrs", "0.1", "0.3", "1", "--out", str(out)]  # fmt: skip
    assert bench.main([*argv, "--max-extensions", "1"]) == 0
    first = json.loads(out.read_text())
    accurate = first["tuning"]["by mean final accuracy"]
    assert accurate["grids"]["lensemble inner"] == pytest.approx([0.01, 0.03, 0.09])
    assert accurate["interior"]["lensemble inner"] is False  # the bound stopped it
    assert any("FAIL: every rate selected by mean final accuracy" in v for v in first["verdicts"])
    assert len(ran) == len(first["results"]) == 2 + 6 + 1 + 3  # initial grids, then 0.09
    ran.clear()
    assert bench.main([*argv, "--reuse", str(out)]) == 0
    second = json.loads(out.read_text())
    assert second["reused"] == 12
    assert sorted({s.inner_lr for s in ran}) == pytest.approx([0.27, 0.81])  # only new rates
    for selection in ("by mean final accuracy", "by fewest rounds to the target"):
        tuned = second["tuning"][selection]
        assert all(tuned["interior"].values()), (selection, tuned)
        assert tuned["picks"]["lensemble inner"] == pytest.approx(0.27)
    assert second["selected"]["lensemble"] == "lensemble (inner lr 0.27, server lr 0.3)"
    assert all(not v.startswith("FAIL: every rate") for v in second["verdicts"])


def test_reuse_refuses_the_results_of_another_task(bench: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "learning.json"
    path.write_text(json.dumps({"task": {"rounds": 30}, "results": []}))
    with pytest.raises(ConfigError, match="reuse"):
        bench.reused_results(path, {"rounds": 10})
