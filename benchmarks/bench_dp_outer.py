"""The outer step under noise, on the digits app in process: which outer learning rate
and momentum still learn when the mean update carries Gaussian noise.

Each arm runs the digits app's federation (10 non-IID partitions, ``DigitsNet``, the
app's inner loop) for ``--rounds`` rounds with local DP at a noise multiplier chosen so
that the forecast noise on the mean update is ``--ratios`` times the clip norm
(``privacy.plan``), over a grid of outer learning rates and momenta, for each seed; it
prints the held-out accuracy of the last round. The budget is set high enough not to
bind: this measures the optimiser, not a privacy plan.

It then picks the step with the best mean accuracy over every ratio and seed, and checks
that the pick has grid values on both sides (``benchmarks/tuning.py``): while the picked
outer lr is the smallest or largest tried, the next lr past it (x or / ``--extend-factor``,
default 2) runs at every ratio and momentum, at most ``--max-extensions`` (default 3)
times a side. Momentum is not extended (it lives in [0, 1)): a picked momentum at the top
of its grid, or at a bottom above 0, is reported at the edge. The final grids and pick are
printed, with a PASS/FAIL line for the edge check.

    python benchmarks/bench_dp_outer.py --rounds 8 --seeds 0,1 --ratios 0.5,2
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tuning import extend_until_interior  # benchmarks/tuning.py, beside this script

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.simulations.digits_data import initial_params
from lensemble_flwr.simulations.digits_inprocess import run_digits


def arm(ratio: float, lr: float, momentum: float, seed: int, rounds: int, tmp: Path) -> float:
    parts = 10
    dim = sum(a.size for a in initial_params().values())
    sigma = ratio * parts**0.5 / dim**0.5  # local DP, uniform mean: sigma C sqrt(P) / sqrt(N)
    privacy = (
        {"clip_norm": 1.0, "noise_multiplier": sigma, "dp_epsilon": 1e9,
         "dp_state_dir": str(tmp / "budgets")}
        if ratio > 0 else {}
    )  # fmt: skip
    config = LensembleConfig(
        federation={"min_participants": 8, "open_timeout": 60.0, "collect_timeout": 60.0,
                    "root_seed": seed, "weighting": "uniform"},
        inner={"steps": 20, "lr": 0.01, "weight_decay": 0.0, "batch_size": 32},
        outer={"lr": lr, "momentum": momentum},
        privacy=privacy,
    )  # fmt: skip
    return run_digits(config, tmp / "run", rounds=rounds, data_seed=seed)[-1]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def best_step(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """The (outer lr, momentum) with the best mean accuracy over every row (ratio) and seed
    run (NaN lowest; ties go to the lower lr, then the lower momentum)."""
    accuracy: dict[tuple[float, float], list[float]] = {}
    for row in rows:
        accuracy.setdefault((row["lr"], row["momentum"]), []).extend(row["accuracy"])

    def key(step: tuple[float, float]) -> float:
        value = mean(accuracy[step])
        return -math.inf if math.isnan(value) else value

    return max(sorted(accuracy), key=key)


def momentum_inside(momenta: list[float], pick: float) -> bool:
    """Whether a picked momentum has grid values on both sides, 0 counting as inside from
    below (no momentum lies under it)."""
    return pick < max(momenta) and (pick > min(momenta) or pick == 0.0)


def sweep(
    args: argparse.Namespace, lrs: list[float], momenta: list[float]
) -> list[dict[str, Any]]:
    """Every ratio x ``lrs`` x ``momenta`` on every seed: one row per step and ratio."""
    rows = []
    for ratio in map(float, args.ratios.split(",")):
        for lr in lrs:
            for momentum in momenta:
                accs = []
                for seed in map(int, args.seeds.split(",")):
                    started = time.perf_counter()
                    with tempfile.TemporaryDirectory(prefix="bench-dp-outer-") as tmp:
                        accs.append(arm(ratio, lr, momentum, seed, args.rounds, Path(tmp)))
                    seconds = time.perf_counter() - started
                rows.append({"ratio": ratio, "lr": lr, "momentum": momentum, "accuracy": accs})
                print(
                    f"ratio {ratio:>4g} lr {lr:>4g} momentum {momentum:>4g}: accuracy "
                    + " ".join(f"{a:.3f}" for a in accs)
                    + f" (mean {mean(accs):.3f}; {seconds:.0f} s a run)",
                    flush=True,
                )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--ratios", default="0,0.5,2")
    parser.add_argument("--lrs", default="0.5,0.7,1,1.5,2")
    parser.add_argument("--momenta", default="0,0.5,0.9")
    parser.add_argument("--extend-factor", type=float, default=2.0)
    parser.add_argument("--max-extensions", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    lrs = sorted(set(map(float, args.lrs.split(","))))
    momenta = sorted(set(map(float, args.momenta.split(","))))
    rows: list[dict[str, Any]] = []

    def run(_: str, lr: float) -> None:
        rows.extend(sweep(args, [lr], momenta))

    def pick() -> dict[str, float]:
        if not rows:  # the first pick: the grid as given
            rows.extend(sweep(args, lrs, momenta))
        return {"lr": best_step(rows)[0]}

    tuned = extend_until_interior(
        {"lr": lrs}, run, pick, factor=args.extend_factor, max_steps=args.max_extensions
    )
    lr, momentum = best_step(rows)
    inside = {"outer lr": tuned["interior"]["lr"], "momentum": momentum_inside(momenta, momentum)}
    print(f"best mean accuracy over every ratio and seed: lr {lr:g}, momentum {momentum:g}")
    final = {"outer lr": (tuned["grids"]["lr"], lr), "momentum": (momenta, momentum)}
    for name, (grid, value) in final.items():
        where = "inside" if inside[name] else "AT THE EDGE of"
        values = [float(f"{v:g}") for v in grid]
        print(f"  {name}: grid {values}, pick {value:g} ({where} the grid)")
    edge = [name for name, ok in inside.items() if not ok]
    print(
        f"{'FAIL' if edge else 'PASS'}: the picked step has grid values on both sides of it"
        + (f"; at an edge: {', '.join(edge)}" if edge else "")
    )
    if args.out is not None:
        args.out.write_text(json.dumps({
            "args": vars(args) | {"out": None}, "rows": rows,
            "pick": {"lr": lr, "momentum": momentum}, "grids": {"lr": tuned["grids"]["lr"],
            "momentum": momenta}, "inside": inside,
        }))  # fmt: skip


if __name__ == "__main__":
    main()
