"""Benchmark: gauge alignment in a federation of latent world models whose frames drift.

Run ``python benchmarks/bench_gauge.py`` (``--help`` for the settings). Every run is the
in-process runtime (a Coordinator and world-model Participants on an InProcessNetwork
with a simulated clock) through its real release path: with ``gauge-align`` each
participant aligns its trained weights on the pinned public probe before it differences
them, and the coordinator announces the probe and checks every update's sketch.

How frames drift. The world model's loss is invariant under any orthogonal change of its
latent frame, so nothing in a participant's objective ties its frame to anyone else's.
The experiment makes that freedom bite: with ``rotate_start`` every participant composes
each global model it receives with its own fixed random orthogonal matrix R_c (Haar on
O(d), seeded per participant) before training. It starts from the same function in its
own frame, and trains there.

Arms, over the same seeds, participants, data and rounds (DiLoCo outer step, lr 0.7,
Nesterov momentum 0.9):
  (a) rotated starts, alignment on;
  (b) rotated starts, alignment off;
  (c) no rotation, alignment off (the control);
and on (c)'s setting, plain averaging (outer lr 1, momentum 0) for ``--plain-factor``
times as many rounds.

Tuning (``--tune-lrs``, default 1e-3, 3e-3 and 7e-3): the two arms the rounds claim
compares, (c) DiLoCo and plain averaging, run at every inner learning rate of the grid.
DiLoCo's is the one with the lowest mean final loss over the seeds; plain averaging's is
the one that reaches that loss in the fewest rounds (median over the seeds): the best case
for the baseline. (a) and (b) run at ``--inner-lr``, and (a)/(c), (b)/(c) compare them
with (c) at that same rate. With ``--tune-lrs`` empty, every arm runs at ``--inner-lr``
only (the benchmark as it first was).

Validation loss = mean over participants of the world-model loss on their own validation
sets, with their own (local) action heads and the global shared weights. The loss is
frame-invariant and the action heads do not carry the frame, so this compares global
models across arms whatever frame they ended in.

Targets, checked on every seed:
  1. (a) ends within 10% of (c)'s final validation loss;
  2. (b) ends at least 2x worse than (c);
  3. DiLoCo (tuned) reaches its final loss in at most half the rounds plain averaging
     (tuned) needs;
  4. no round attempt aborted in any run (a retried round is still reported here).
A round that never closed (the federation stopped) has a NaN loss and drift, so every
ratio that needs it is NaN and its target fails.
Writes ``benchmarks/results/gauge.json`` and ``benchmarks/results/gauge.png`` and prints one
PASS/FAIL line per target. A report, not a test: the exit code is 0 whatever the outcome.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.coordinator import RoundOutcome
from lensemble_flwr.errors import LensembleError
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.simulations.world_federation import build_world, validation_loss

RESULTS = Path(__file__).resolve().parent / "results"
ARMS = {
    "aligned": {"align": True, "rotate": True, "outer": "diloco"},
    "unaligned": {"align": False, "rotate": True, "outer": "diloco"},
    "control": {"align": False, "rotate": False, "outer": "diloco"},
    "plain-averaging": {"align": False, "rotate": False, "outer": "plain"},
}
OUTER = {"diloco": {"lr": 0.7, "momentum": 0.9}, "plain": {"lr": 1.0, "momentum": 0.0}}


def run_arm(
    args: argparse.Namespace, arm: str, seed: int, rounds: int, inner_lr: float | None = None
) -> dict[str, Any]:
    """One federation: the validation loss after every round (index 0: the initial model)
    and the frame drift of each round (index 0: round 1), NaN for a round that never
    closed; the aborted attempts; whether and why the federation stopped early."""
    spec = ARMS[arm]
    config = LensembleConfig(
        federation={
            "min_participants": args.participants,
            "open_timeout": 60.0,
            "collect_timeout": 60.0,
            "root_seed": seed,
        },
        inner={
            "steps": args.inner_steps,
            "lr": args.inner_lr if inner_lr is None else inner_lr,
            "weight_decay": 0.0,
            "batch_size": args.batch_size,
        },
        outer=OUTER[spec["outer"]],
        gauge={"align": spec["align"], "sketch_rows": args.sketch_rows},
    )
    nan = float("nan")
    losses = [nan] * (rounds + 1)
    drift = [nan] * rounds
    aborted: list[str] = []
    stopped: str | None = None

    def on_round(outcome: RoundOutcome) -> None:
        # Coordinator.run retries an aborted round: the next attempt carries the same index
        if outcome.state is not RoundState.CLOSED:
            aborted.append(f"round {outcome.round}: {outcome.reason}")
            return
        # round r (from 1) takes θ_{r-1} to θ_r: its loss is index r, its drift index r - 1
        losses[outcome.round] = validation_loss(
            fed.coordinator.global_state().params, fed.trainers
        )
        drift[outcome.round - 1] = float(outcome.diagnostics.get("frame_drift", nan))

    with tempfile.TemporaryDirectory(prefix="bench-gauge-") as run_dir:
        fed = build_world(
            config,
            Path(run_dir) / "run",
            participants=args.participants,
            data_seed=seed,
            init_seed=seed,
            rotate_start=spec["rotate"],
            trajectories=args.trajectories,
            on_round=on_round,
        )
        losses[0] = validation_loss(fed.coordinator.global_state().params, fed.trainers)
        started = time.perf_counter()
        try:
            fed.coordinator.run(rounds)
        except LensembleError as exc:  # the later rounds stay NaN; the report goes on
            stopped = f"{type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - started
    return {
        "loss": losses,
        "frame_drift": drift,
        "aborted": aborted,
        "stopped": stopped,
        "seconds": seconds,
    }


def first_round_at_or_below(curve: Sequence[float], level: float) -> int | None:
    """The first round index whose loss is <= level (index 0 is the initial model)."""
    return next((i for i, v in enumerate(curve) if v <= level), None)


def evaluate_seed(runs: dict[str, dict[str, Any]], rounds: int) -> dict[str, Any]:
    control = runs["control"]["loss"]
    final = control[rounds]
    diloco = first_round_at_or_below(control, final)  # None only if final is NaN
    plain = first_round_at_or_below(runs["plain-averaging"]["loss"], final)
    plain_budget = len(runs["plain-averaging"]["loss"]) - 1
    if diloco is None:
        ratio = float("nan")
    elif plain is not None:
        ratio = diloco / plain
    else:  # not reached within the budget: the true ratio is below diloco / budget
        ratio = diloco / plain_budget
    return {
        "loss_at_round_R": {arm: run["loss"][rounds] for arm, run in runs.items()},
        "aligned_over_control": runs["aligned"]["loss"][rounds] / final,
        "unaligned_over_control": runs["unaligned"]["loss"][rounds] / final,
        "diloco_rounds": diloco,
        "plain_rounds": plain,
        "plain_budget": plain_budget,
        "rounds_ratio": ratio,
        "plain_reached": plain is not None,
        "aborted_attempts": sum(len(run["aborted"]) for run in runs.values()),
        "stopped": {arm: run["stopped"] for arm, run in runs.items() if run["stopped"]},
    }


def tune(
    by_lr: dict[float, dict[str, dict[str, dict[str, Any]]]], rounds: int
) -> dict[str, Any]:
    """DiLoCo's inner lr (lowest mean final loss), then per seed the rounds DiLoCo takes to
    its final loss and the rounds plain averaging takes to the same loss at each of its
    rates; plain averaging's rate is the one with the fewest rounds (median over seeds)."""
    lrs = sorted(by_lr)
    seeds = sorted(next(iter(by_lr.values())))

    def final(lr: float, seed: str) -> float:
        return by_lr[lr][seed]["control"]["loss"][rounds]

    diloco_lr = min(lrs, key=lambda lr: float(np.mean([final(lr, s) for s in seeds])))
    per_seed: dict[str, Any] = {}
    plain_rounds: dict[float, list[float]] = {lr: [] for lr in lrs}
    for seed in seeds:
        target = final(diloco_lr, seed)
        curve = by_lr[diloco_lr][seed]["control"]["loss"]
        per_seed[seed] = {"target": target, "diloco_rounds": first_round_at_or_below(curve, target)}
        for lr in lrs:
            plain = by_lr[lr][seed]["plain-averaging"]["loss"]
            reached = first_round_at_or_below(plain, target)
            plain_rounds[lr].append(float("inf") if reached is None else float(reached))
    plain_lr = min(lrs, key=lambda lr: float(np.median(plain_rounds[lr])))
    budget = len(by_lr[plain_lr][seeds[0]]["plain-averaging"]["loss"]) - 1
    for i, seed in enumerate(seeds):
        d, p = per_seed[seed]["diloco_rounds"], plain_rounds[plain_lr][i]
        reached = math.isfinite(p)
        per_seed[seed] |= {
            "plain_rounds": int(p) if reached else None,
            "plain_reached": reached,
            "rounds_ratio": float("nan") if d is None else d / (p if reached else budget),
        }
    return {
        "diloco_inner_lr": diloco_lr,
        "plain_inner_lr": plain_lr,
        "plain_budget": budget,
        "diloco_final_loss": {lr: [final(lr, s) for s in seeds] for lr in lrs},
        "plain_rounds_to_target": {lr: plain_rounds[lr] for lr in lrs},
        "per_seed": per_seed,
    }


def worst(values: Sequence[float], pick: Any) -> float:
    """``pick`` (max or min) of ``values``, NaN if any is NaN (max/min would skip it or
    not depending on where it sits)."""
    return float("nan") if any(math.isnan(v) for v in values) else pick(values)


def verdicts(
    per_seed: dict[int, dict[str, Any]], tuned: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    seeds = list(per_seed.values())
    worst_a = worst([s["aligned_over_control"] for s in seeds], max)
    worst_b = worst([s["unaligned_over_control"] for s in seeds], min)
    compared = list(tuned["per_seed"].values()) if tuned else seeds
    worst_rounds = worst([s["rounds_ratio"] for s in compared], max)
    aborted = sum(s["aborted_attempts"] for s in seeds)
    stopped = sum(len(s["stopped"]) for s in seeds)
    bound = (
        "" if all(s["plain_reached"] for s in compared) else " (upper bound: plain not reached)"
    )
    which = (
        f"inner lr tuned: DiLoCo {tuned['diloco_inner_lr']:g}, plain {tuned['plain_inner_lr']:g}"
        if tuned
        else "inner lr not tuned"
    )
    return [
        {
            "target": "(a) aligned ends within 10% of (c) control",
            "measure": "max over seeds of final loss (a) / (c)",
            "value": worst_a,
            "threshold": "<= 1.10",
            "pass": worst_a <= 1.10,
        },
        {
            "target": "(b) unaligned ends at least 2x worse than (c)",
            "measure": "min over seeds of final loss (b) / (c)",
            "value": worst_b,
            "threshold": ">= 2.0",
            "pass": worst_b >= 2.0,
        },
        {
            "target": "DiLoCo reaches its final loss in <= half the rounds of plain averaging",
            "measure": f"max over seeds of rounds(DiLoCo) / rounds(plain), {which}" + bound,
            "value": worst_rounds,
            "threshold": "<= 0.5",
            "pass": worst_rounds <= 0.5,
        },
        {
            "target": "no round attempt aborted, no federation stopped early",
            "measure": "aborted attempts + stopped runs over all arms and seeds",
            "value": aborted + stopped,
            "threshold": "== 0",
            "pass": aborted + stopped == 0,
        },
    ]


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = results["seeds"]
    runs = results["runs"]
    colors = {
        "aligned": "tab:blue",
        "unaligned": "tab:red",
        "control": "tab:green",
        "plain-averaging": "tab:gray",
    }
    labels = {
        "aligned": "(a) rotated starts, aligned",
        "unaligned": "(b) rotated starts, not aligned",
        "control": "(c) no rotation (control)",
        "plain-averaging": "(c) with plain averaging (lr 1, no momentum)",
    }
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))

    def draw(ax: Any, arm: str, key: str, start: int = 0) -> None:
        curves = np.array([runs[str(s)][arm][key] for s in seeds])
        x = np.arange(start, start + curves.shape[1])
        for curve in curves:
            ax.plot(x, curve, color=colors[arm], alpha=0.25, linewidth=0.8)
        ax.plot(x, curves.mean(axis=0), color=colors[arm], linewidth=2, label=labels[arm])

    ax = axes[0]
    for arm in ("aligned", "unaligned", "control"):
        draw(ax, arm, "loss")
    ax.set(xlabel="round", ylabel="validation loss", title="Alignment under drifting frames")
    ax.legend(fontsize=8)

    ax = axes[1]
    for arm in ("control", "plain-averaging"):
        draw(ax, arm, "loss")
    for s in seeds:
        seed = results["per_seed"][str(s)]
        ax.axhline(
            seed["loss_at_round_R"]["control"], color="tab:green", linestyle=":", linewidth=0.8
        )
        if seed["plain_rounds"] is not None:
            ax.axvline(seed["plain_rounds"], color="tab:gray", linestyle=":", linewidth=0.8)
    ax.set(
        xlabel="round",
        ylabel="validation loss",
        title="Outer step on (c): DiLoCo vs plain averaging",
    )
    ax.legend(fontsize=8)

    ax = axes[2]
    for arm in ("aligned", "unaligned", "control"):
        draw(ax, arm, "frame_drift", start=1)
    ax.set(
        xlabel="round",
        ylabel="frame drift of the global model",
        title="frame_drift (public probe, per round)",
        ylim=(0, None),
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--participants", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument(
        "--plain-factor",
        type=int,
        default=4,
        help="plain averaging runs "
        "this many times --rounds, to find when it reaches (c)'s final loss",
    )
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--inner-lr", type=float, default=1e-3)
    parser.add_argument(
        "--tune-lrs", type=float, nargs="*", default=[1e-3, 3e-3, 7e-3],
        help="inner learning rates (c) and plain averaging are tuned over (none: no tuning)",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--sketch-rows", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)  # tiny models: one thread is faster, and the machine is shared

    started = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    per_seed: dict[str, dict[str, Any]] = {}
    by_lr: dict[float, dict[str, dict[str, dict[str, Any]]]] = {}
    for seed in args.seeds:
        seed_runs = {}
        for arm in ARMS:
            rounds = args.rounds * (args.plain_factor if arm == "plain-averaging" else 1)
            seed_runs[arm] = run_arm(args, arm, seed, rounds)
            run = seed_runs[arm]
            print(
                f"seed {seed} {arm:<16} {rounds:4d} rounds in {run['seconds']:5.1f} s: "
                f"loss {run['loss'][0]:.4f} -> {run['loss'][args.rounds]:.4f} at round "
                f"{args.rounds}"
                + (f", {len(run['aborted'])} aborted" if run["aborted"] else "")
                + (f", stopped: {run['stopped']}" if run["stopped"] else ""),
                flush=True,
            )
        runs[str(seed)] = seed_runs
        per_seed[str(seed)] = evaluate_seed(seed_runs, args.rounds)
        for lr in args.tune_lrs:
            tuned_runs = by_lr.setdefault(lr, {}).setdefault(str(seed), {})
            for arm in ("control", "plain-averaging"):
                if lr == args.inner_lr:
                    tuned_runs[arm] = seed_runs[arm]
                    continue
                rounds = args.rounds * (args.plain_factor if arm == "plain-averaging" else 1)
                tuned_runs[arm] = run_arm(args, arm, seed, rounds, inner_lr=lr)
                run = tuned_runs[arm]
                print(
                    f"seed {seed} {arm:<16} inner lr {lr:g}: {rounds:4d} rounds in "
                    f"{run['seconds']:5.1f} s: loss {run['loss'][args.rounds]:.4f} at round "
                    f"{args.rounds}, {run['loss'][-1]:.4f} at round {rounds}",
                    flush=True,
                )

    tuned = tune(by_lr, args.rounds) if by_lr else None
    checks = verdicts({int(s): v for s, v in per_seed.items()}, tuned)
    results = {
        "command": "python benchmarks/bench_gauge.py " + " ".join(argv or sys.argv[1:]),
        # (not --out: no path of the machine goes into the results)
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "outer": OUTER,
        "arms": ARMS,
        "seeds": args.seeds,
        "per_seed": per_seed,
        "tuned": tuned,
        "tuned_runs": {str(lr): v for lr, v in by_lr.items() if lr != args.inner_lr},
        "targets": checks,
        "seconds": time.perf_counter() - started,
        "machine": {"python": platform.python_version(), "torch": torch.__version__},
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gauge.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out / "gauge.png")

    print()
    print(f"seed  (a)/(c)  (b)/(c)  rounds DiLoCo / plain at inner lr {args.inner_lr:g}  tuned")
    for seed, s in per_seed.items():
        plain = s["plain_rounds"] if s["plain_reached"] else f">{s['plain_budget']}"
        line = (
            f"{seed:>4}  {s['aligned_over_control']:7.3f}  {s['unaligned_over_control']:7.3f}"
            f"  {s['diloco_rounds']} / {plain} = {s['rounds_ratio']:.2f}"
        )
        if tuned:
            t = tuned["per_seed"][seed]
            tp = t["plain_rounds"] if t["plain_reached"] else f">{tuned['plain_budget']}"
            line += f"{'':28}{t['diloco_rounds']} / {tp} = {t['rounds_ratio']:.2f}"
        print(line)
    if tuned:
        print(
            f"tuned over inner lr {args.tune_lrs}: DiLoCo {tuned['diloco_inner_lr']:g} "
            f"(mean final loss by lr: "
            + ", ".join(f"{lr:g}: {np.mean(v):.4f}" for lr, v in tuned["diloco_final_loss"].items())
            + f"); plain averaging {tuned['plain_inner_lr']:g} (median rounds to DiLoCo's "
            "final loss by lr: "
            + ", ".join(
                f"{lr:g}: {np.median(v):g}" for lr, v in tuned["plain_rounds_to_target"].items()
            )
            + ")"
        )
    print(
        f"\n{len(args.seeds)} seeds in {results['seconds']:.0f} s; wrote "
        f"{args.out / 'gauge.json'} and {args.out / 'gauge.png'}"
    )
    for check in checks:
        verdict = "PASS" if check["pass"] else "FAIL"
        print(
            f"{verdict}: {check['target']}: {check['measure']} = {check['value']:.3f} "
            f"({check['threshold']})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
