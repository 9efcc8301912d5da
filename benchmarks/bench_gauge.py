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

Tuning (``--tune-lrs``, default 3e-3, 7e-3, 1.5e-2 and 3e-2) on ``--tune-seeds``
(default 0, 1, 2), which the evaluation seeds ``--seeds`` (default 5, 6, 7) must not
share: the two arms the rounds claim compares, (c) DiLoCo and plain averaging, run at
every inner learning rate of the grid on the tuning seeds. DiLoCo's rate is the one with
the lowest mean final loss; plain averaging's the one that reaches that loss (seed by
seed) in the fewest rounds, median over the seeds: the best case for the baseline. Each
arm's grid must extend past its pick: while a pick is the smallest or largest rate tried,
the next rate past it (x or / ``--extend-factor``, default 2) is run and both arms are
picked again, at most ``--max-extensions`` (default 3) times per arm and side; the final
grids and picks are printed, and a pick still at an edge fails a target. The evaluation
seeds then run both arms at the picked rates. (a) and (b) run at ``--inner-lr``, and
(a)/(c), (b)/(c) compare them with (c) at that same rate. With ``--tune-lrs`` empty,
every arm runs at ``--inner-lr`` only (the benchmark as it first was).

Validation loss = mean over participants of the world-model loss on their own validation
sets, with their own (local) action heads and the global shared weights. The loss is
frame-invariant and the action heads do not carry the frame, so this compares global
models across arms whatever frame they ended in.

Targets, checked on every seed:
  1. (a) ends within 10% of (c)'s final validation loss;
  2. (b) ends at least 2x worse than (c);
  3. DiLoCo (tuned) reaches its final loss in at most half the rounds plain averaging
     (tuned) needs, on the held-out seeds;
  4. no round attempt aborted in any run (a retried round is still reported here);
  5. with tuning, both picks have grid values on both sides.
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
from tuning import extend_until_interior  # benchmarks/tuning.py, beside this script

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


def rounds_ratio(
    diloco: Sequence[float], plain: Sequence[float], rounds: int
) -> dict[str, Any]:
    """The rounds DiLoCo's curve takes to its loss at ``rounds`` over the rounds plain
    averaging's curve takes to that loss. Plain averaging not reaching it within its
    budget makes the ratio an upper bound (DiLoCo's rounds over the budget); a NaN final
    loss makes it NaN."""
    target = diloco[rounds]
    d = first_round_at_or_below(diloco, target)  # None only if target is NaN
    p = first_round_at_or_below(plain, target)
    budget = len(plain) - 1
    ratio = float("nan") if d is None else d / max(p if p is not None else budget, 1)
    return {
        "target": target,
        "diloco_rounds": d,
        "plain_rounds": p,
        "plain_budget": budget,
        "plain_reached": p is not None,
        "rounds_ratio": ratio,
    }


def evaluate_seed(runs: dict[str, dict[str, Any]], rounds: int) -> dict[str, Any]:
    final = runs["control"]["loss"][rounds]
    ratio = rounds_ratio(runs["control"]["loss"], runs["plain-averaging"]["loss"], rounds)
    return {
        "loss_at_round_R": {arm: run["loss"][rounds] for arm, run in runs.items()},
        "aligned_over_control": runs["aligned"]["loss"][rounds] / final,
        "unaligned_over_control": runs["unaligned"]["loss"][rounds] / final,
        **{k: v for k, v in ratio.items() if k != "target"},
        "aborted_attempts": sum(len(run["aborted"]) for run in runs.values()),
        "stopped": {arm: run["stopped"] for arm, run in runs.items() if run["stopped"]},
    }


def _finite(value: float) -> float:
    """NaN (a diverged or stopped run) sorts after every real figure."""
    return math.inf if math.isnan(value) else value


def tune(
    diloco: dict[float, dict[str, dict[str, Any]]],
    plain: dict[float, dict[str, dict[str, Any]]],
    rounds: int,
) -> dict[str, Any]:
    """Both arms' inner lr from their runs (lr -> seed -> run) on the tuning seeds.
    DiLoCo's is the one with the lowest mean loss at ``rounds``. Plain averaging's is the
    one that reaches DiLoCo's final loss (seed by seed) in the fewest rounds, median over
    the seeds, ties going to the lower mean loss at the end of its budget: the best case
    for the baseline. Also the per-seed rounds ratio at those rates (in-sample)."""
    seeds = sorted(next(iter(diloco.values())))

    def final(lr: float, seed: str) -> float:
        return diloco[lr][seed]["loss"][rounds]

    diloco_lr = min(
        sorted(diloco), key=lambda lr: _finite(float(np.mean([final(lr, s) for s in seeds])))
    )
    plain_rounds: dict[float, list[float]] = {}
    for lr in sorted(plain):
        reached = [
            first_round_at_or_below(plain[lr][s]["loss"], final(diloco_lr, s)) for s in seeds
        ]
        plain_rounds[lr] = [math.inf if r is None else float(r) for r in reached]

    def plain_key(lr: float) -> tuple[float, float]:
        end = _finite(float(np.mean([plain[lr][s]["loss"][-1] for s in seeds])))
        return float(np.median(plain_rounds[lr])), end

    plain_lr = min(sorted(plain), key=plain_key)
    per_seed = {
        s: rounds_ratio(diloco[diloco_lr][s]["loss"], plain[plain_lr][s]["loss"], rounds)
        for s in seeds
    }
    return {
        "diloco_inner_lr": diloco_lr,
        "plain_inner_lr": plain_lr,
        "diloco_final_loss": {lr: [final(lr, s) for s in seeds] for lr in sorted(diloco)},
        "plain_rounds_to_target": plain_rounds,
        "per_seed": per_seed,
    }


def worst(values: Sequence[float], pick: Any) -> float:
    """``pick`` (max or min) of ``values``, NaN if any is NaN (max/min would skip it or
    not depending on where it sits)."""
    return float("nan") if any(math.isnan(v) for v in values) else pick(values)


def verdicts(
    per_seed: dict[int, dict[str, Any]],
    tuned: dict[str, Any] | None = None,
    held_out: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One verdict per target. With tuning, the rounds target reads the held-out seeds'
    ratios at the tuned rates, and a fifth target asks that both picks have grid values
    on both sides."""
    seeds = list(per_seed.values())
    worst_a = worst([s["aligned_over_control"] for s in seeds], max)
    worst_b = worst([s["unaligned_over_control"] for s in seeds], min)
    compared = list(held_out.values()) if tuned and held_out else seeds
    worst_rounds = worst([s["rounds_ratio"] for s in compared], max)
    aborted = sum(s["aborted_attempts"] for s in seeds)
    stopped = sum(len(s["stopped"]) for s in seeds)
    bound = (
        "" if all(s["plain_reached"] for s in compared) else " (upper bound: plain not reached)"
    )
    which = (
        f"held-out seeds, inner lr tuned on seeds {tuned['tune_seeds']}: "
        f"DiLoCo {tuned['diloco_inner_lr']:g}, plain {tuned['plain_inner_lr']:g}"
        if tuned
        else "inner lr not tuned"
    )
    checks = [
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
    if tuned:
        edge = [arm for arm, inside in tuned["interior"].items() if not inside]
        checks.append(
            {
                "target": "every tuned inner lr has grid values on both sides of it",
                "measure": "arms whose pick is at an edge of its grid"
                + (f" ({', '.join(edge)})" if edge else ""),
                "value": len(edge),
                "threshold": "== 0",
                "pass": not edge,
            }
        )
    return checks


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = results["seeds"]
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

    def draw(ax: Any, arm: str, key: str, start: int = 0, source: str = "runs") -> None:
        curves = np.array([results[source][str(s)][arm][key] for s in seeds])
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
    tuned = results["tuned"]
    source, marks = ("tuned_runs", results["held_out"]) if tuned else ("runs", results["per_seed"])
    if tuned:
        labels["control"] = f"(c) DiLoCo, inner lr {tuned['diloco_inner_lr']:g} (tuned)"
        labels["plain-averaging"] = f"plain averaging, inner lr {tuned['plain_inner_lr']:g} (tuned)"
    for arm in ("control", "plain-averaging"):
        draw(ax, arm, "loss", source=source)
    for s in seeds:
        mark = marks[str(s)]
        ax.axhline(mark["target"], color="tab:green", linestyle=":", linewidth=0.8)
        if mark["plain_rounds"] is not None:
            ax.axvline(mark["plain_rounds"], color="tab:gray", linestyle=":", linewidth=0.8)
    ax.set(
        xlabel="round",
        ylabel="validation loss",
        title="Outer step on (c): DiLoCo vs plain averaging",
    )
    ax.legend(fontsize=8)

    ax = axes[2]
    labels["control"] = "(c) no rotation (control)"
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


def arm_rounds(args: argparse.Namespace, arm: str) -> int:
    return args.rounds * (args.plain_factor if arm == "plain-averaging" else 1)


def report_run(
    args: argparse.Namespace, seed: int, arm: str, run: dict[str, Any], lr: float
) -> None:
    rounds = len(run["loss"]) - 1
    print(
        f"seed {seed} {arm:<16} inner lr {lr:<7g} {rounds:4d} rounds in {run['seconds']:5.1f} s: "
        f"loss {run['loss'][0]:.4f} -> {run['loss'][args.rounds]:.4f} at round {args.rounds}"
        + (f", {run['loss'][-1]:.4f} at round {rounds}" if rounds != args.rounds else "")
        + (f", {len(run['aborted'])} aborted" if run["aborted"] else "")
        + (f", stopped: {run['stopped']}" if run["stopped"] else ""),
        flush=True,
    )


def run_tuning(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(c) DiLoCo and plain averaging at every rate of --tune-lrs on the tuning seeds, each
    arm's grid extended past its pick (``extend_until_interior``); the tuning and its runs
    (arm -> lr -> seed -> run)."""
    runs: dict[str, dict[float, dict[str, dict[str, Any]]]] = {
        "control": {},
        "plain-averaging": {},
    }

    def run(arm: str, lr: float) -> None:
        for seed in args.tune_seeds:
            result = run_arm(args, arm, seed, arm_rounds(args, arm), inner_lr=lr)
            runs[arm].setdefault(lr, {})[str(seed)] = result
            report_run(args, seed, arm, result, lr)

    grids = {arm: sorted(set(args.tune_lrs)) for arm in runs}
    for lr in grids["control"]:
        for arm in runs:
            run(arm, lr)

    def pick() -> dict[str, float]:
        t = tune(runs["control"], runs["plain-averaging"], args.rounds)
        return {"control": t["diloco_inner_lr"], "plain-averaging": t["plain_inner_lr"]}

    grid = extend_until_interior(
        grids, run, pick, factor=args.extend_factor, max_steps=args.max_extensions
    )
    tuned = tune(runs["control"], runs["plain-averaging"], args.rounds)
    tuned |= {
        "tune_seeds": args.tune_seeds,
        "grids": grid["grids"],
        "interior": grid["interior"],
        "extensions": grid["extensions"],
    }
    for arm, name in (("control", "DiLoCo"), ("plain-averaging", "plain averaging")):
        pick_lr = grid["picks"][arm]
        where = "inside" if grid["interior"][arm] else "AT THE EDGE of"
        print(
            f"{name}: final grid {[float(f'{v:g}') for v in grid['grids'][arm]]}, "
            f"pick {pick_lr:g} ({where} the grid)",
            flush=True,
        )
    return tuned, {arm: {str(lr): v for lr, v in by_lr.items()} for arm, by_lr in runs.items()}


def run_seed(
    args: argparse.Namespace, seed: int, tuned: dict[str, Any] | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The four arms at --inner-lr on one evaluation seed, and (c) DiLoCo and plain
    averaging at their tuned rates (empty without tuning)."""
    seed_runs = {}
    for arm in ARMS:
        seed_runs[arm] = run_arm(args, arm, seed, arm_rounds(args, arm))
        report_run(args, seed, arm, seed_runs[arm], args.inner_lr)
    tuned_runs = {}
    if tuned:
        lrs = {"control": tuned["diloco_inner_lr"], "plain-averaging": tuned["plain_inner_lr"]}
        for arm, lr in lrs.items():
            if lr == args.inner_lr:
                tuned_runs[arm] = seed_runs[arm]
                continue
            tuned_runs[arm] = run_arm(args, arm, seed, arm_rounds(args, arm), inner_lr=lr)
            report_run(args, seed, arm, tuned_runs[arm], lr)
    return seed_runs, tuned_runs


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--participants", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[5, 6, 7],
        help="evaluation seeds (with tuning: held out, none of --tune-seeds)",
    )  # fmt: skip
    parser.add_argument(
        "--tune-seeds", type=int, nargs="+", default=[0, 1, 2],
        help="the seeds the inner learning rates are tuned on",
    )  # fmt: skip
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
        "--tune-lrs", type=float, nargs="*", default=[3e-3, 7e-3, 1.5e-2, 3e-2],
        help="inner learning rates (c) and plain averaging are tuned over, each arm's grid "
        "extended past its pick (none: no tuning)",
    )  # fmt: skip
    parser.add_argument(
        "--extend-factor", type=float, default=2.0,
        help="a pick at an edge of its grid adds edge x this (or / this) and tunes again",
    )  # fmt: skip
    parser.add_argument(
        "--max-extensions", type=int, default=3,
        help="at most this many added rates per arm and side of its grid",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--sketch-rows", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.tune_lrs and set(args.seeds) & set(args.tune_seeds):
        parser.error(
            f"--seeds {args.seeds} and --tune-seeds {args.tune_seeds} overlap: the "
            "evaluation seeds must be held out from tuning"
        )
    return args


def print_summary(
    args: argparse.Namespace, results: dict[str, Any], checks: list[dict[str, Any]]
) -> None:
    per_seed, tuned, held_out = results["per_seed"], results["tuned"], results["held_out"]
    print()
    print(f"seed  (a)/(c)  (b)/(c)  rounds DiLoCo / plain at inner lr {args.inner_lr:g}  tuned")
    for seed, s in per_seed.items():
        plain = s["plain_rounds"] if s["plain_reached"] else f">{s['plain_budget']}"
        line = (
            f"{seed:>4}  {s['aligned_over_control']:7.3f}  {s['unaligned_over_control']:7.3f}"
            f"  {s['diloco_rounds']} / {plain} = {s['rounds_ratio']:.2f}"
        )
        if tuned:
            t = held_out[seed]
            tp = t["plain_rounds"] if t["plain_reached"] else f">{t['plain_budget']}"
            line += f"{'':28}{t['diloco_rounds']} / {tp} = {t['rounds_ratio']:.2f}"
        print(line)
    if tuned:
        print(
            f"tuned on seeds {args.tune_seeds}: DiLoCo {tuned['diloco_inner_lr']:g} (mean final "
            "loss by lr: "
            + ", ".join(f"{lr:g}: {np.mean(v):.4f}" for lr, v in tuned["diloco_final_loss"].items())
            + f"); plain averaging {tuned['plain_inner_lr']:g} (median rounds to DiLoCo's "
            "final loss by lr: "
            + ", ".join(
                f"{lr:g}: {np.median(v):g}" for lr, v in tuned["plain_rounds_to_target"].items()
            )
            + ")"
        )
        print(
            "in-sample (tuning seeds) rounds DiLoCo / plain: "
            + ", ".join(
                f"seed {s}: {t['diloco_rounds']} / "
                f"{t['plain_rounds'] if t['plain_reached'] else '>' + str(t['plain_budget'])}"
                f" = {t['rounds_ratio']:.2f}"
                for s, t in tuned["per_seed"].items()
            )
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


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)  # tiny models: one thread is faster, and the machine is shared

    started = time.perf_counter()
    tuned, tuning_runs = run_tuning(args) if args.tune_lrs else (None, {})
    runs: dict[str, dict[str, Any]] = {}
    tuned_runs: dict[str, dict[str, Any]] = {}
    per_seed: dict[str, dict[str, Any]] = {}
    held_out: dict[str, dict[str, Any]] = {}
    for seed in args.seeds:
        runs[str(seed)], tuned_runs[str(seed)] = run_seed(args, seed, tuned)
        per_seed[str(seed)] = evaluate_seed(runs[str(seed)], args.rounds)
        if tuned:
            held_out[str(seed)] = rounds_ratio(
                tuned_runs[str(seed)]["control"]["loss"],
                tuned_runs[str(seed)]["plain-averaging"]["loss"],
                args.rounds,
            )
    checks = verdicts({int(s): v for s, v in per_seed.items()}, tuned, held_out)
    results = {
        "command": "python benchmarks/bench_gauge.py " + " ".join(argv or sys.argv[1:]),
        # (not --out: no path of the machine goes into the results)
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "outer": OUTER,
        "arms": ARMS,
        "seeds": args.seeds,
        "per_seed": per_seed,
        "tuned": tuned,
        "held_out": held_out,
        "targets": checks,
        "seconds": time.perf_counter() - started,
        "machine": {"python": platform.python_version(), "torch": torch.__version__},
        "runs": runs,
        "tuned_runs": tuned_runs if tuned else {},
        "tuning_runs": tuning_runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gauge.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out / "gauge.png")
    print_summary(args, results, checks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
