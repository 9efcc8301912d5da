"""The outer step under noise, on the digits app in process: which outer learning rate
and momentum still learn when the mean update carries Gaussian noise.

Each arm runs the digits app's federation (10 non-IID partitions, ``DigitsNet``, the
app's inner loop) for ``--rounds`` rounds with local DP at a noise multiplier chosen so
that the forecast noise on the mean update is ``--ratios`` times the clip norm
(``privacy.plan``), over a grid of outer learning rates and momenta, for each seed; it
prints the held-out accuracy of the last round. The budget is set high enough not to
bind: this measures the optimiser, not a privacy plan.

    python benchmarks/bench_dp_outer.py --rounds 8 --seeds 0,1 --ratios 0.5,2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--ratios", default="0,0.5,2")
    parser.add_argument("--lrs", default="0.5,0.7,1,1.5,2")
    parser.add_argument("--momenta", default="0,0.5,0.9")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for ratio in map(float, args.ratios.split(",")):
        for lr in map(float, args.lrs.split(",")):
            for momentum in map(float, args.momenta.split(",")):
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
                    + f" (mean {sum(accs) / len(accs):.3f}; {seconds:.0f} s a run)",
                    flush=True,
                )
    if args.out is not None:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": None}, "rows": rows}))


if __name__ == "__main__":
    main()
