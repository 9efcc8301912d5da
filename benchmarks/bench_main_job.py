"""Benchmark: does federating pay in the main job? Federated vs tuned local-only vs
tuned centralized, on held-out data.

Run ``python benchmarks/bench_main_job.py`` (``--help`` for the settings). It reads the
main job's settings from the repository's ``pyproject.toml`` (``[tool.flwr.app.config]``:
rounds, partitions, data keys, and the ``lensemble`` table through
``LensembleConfig.from_run_config``, as the ServerApp and ClientApps do) and runs, per
seed (``data-seed`` = ``init-seed`` = ``root-seed`` = the seed):

* **federated**: the in-process runtime (a Coordinator and the world-model Participants
  on an InProcessNetwork with a simulated clock, :func:`build_world`), with the release
  path of the main job (alignment on the pinned probe, DiLoCo outer step, local action
  heads), at its own settings: ``num-server-rounds`` rounds at the run config's
  ``inner-lr``, nothing tuned. It is the code ``./dev.sh main`` runs on every node and in
  the strategy, minus Flower's message transport; every node joins every round;
* **tuned local-only**: each node alone, its learning rate (a grid around ``inner-lr``
  that grows past an edge pick) and its stopping step chosen on the first half of its
  validation trajectories (:func:`world_tuning.tuned_local_only`);
* **tuned centralized**: one encoder and predictor, a head per node, batches from every
  node, trained until the nodes' mean tuning loss stops improving, its learning rate
  chosen the same way (:func:`world_tuning.tuned_centralized`).

Measure: each node's loss on the second half of its validation trajectories (the
scoring half, which chose nothing), the federated model after the last round with the
node's own head. Targets, on every seed:
  1. federated beats tuned local-only on at least 8 of the nodes (of 10);
  2. federated beats tuned local-only on the mean over nodes.
Writes ``benchmarks/results/main_job.json`` and ``benchmarks/results/main_job.png`` and
prints the per-node table and one PASS/FAIL line per target and seed. A report, not a
test: the exit code is 0 whatever the outcome.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import tomllib
import torch

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.simulations.world_data import participant_data
from lensemble_flwr.simulations.world_federation import build_world
from lensemble_flwr.simulations.world_tuning import (
    LrSearch,
    split_validation,
    tuned_centralized,
    tuned_local_only,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
MIN_WINS = 8


def main_job_settings(pyproject: Path) -> dict[str, Any]:
    """The main job's run config, flattened as Flower hands it to the apps."""
    table = tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"]
    flat = {k: v for k, v in table.items() if k != "lensemble"}
    flat.update({f"lensemble.{k}": v for k, v in table["lensemble"].items()})
    return flat


def federated(
    config: LensembleConfig, data: dict[str, Any], seed: int, nodes: int, rounds: int
) -> dict[str, Any]:
    """The main job in process: per node, the tuning- and scoring-half losses of the
    global model (with the node's own head) after every round (index 0: the start)."""
    tune: list[list[float]] = [[] for _ in range(nodes)]
    score: list[list[float]] = [[] for _ in range(nodes)]
    with tempfile.TemporaryDirectory(prefix="bench-main-job-") as run_dir:
        fed = build_world(
            config,
            Path(run_dir) / "run",
            participants=nodes,
            data_seed=seed,
            init_seed=seed,
            **data,
        )
        halves = [
            split_validation(t.data.validation, data["validation_trajectories"])
            for t in fed.trainers
        ]

        def record() -> None:
            params = fed.coordinator.global_state().params
            for i, (trainer, (t, s)) in enumerate(zip(fed.trainers, halves, strict=True)):
                tune[i].append(trainer.loss_on(t, params))
                score[i].append(trainer.loss_on(s, params))

        record()
        aborted = 0
        for _ in range(rounds):
            seen = len(fed.coordinator.outcomes)
            fed.coordinator.run(1)
            new = fed.coordinator.outcomes[seen:]  # the latest only are kept
            aborted += sum(o.state is RoundState.ABORTED for o in new)
            record()
    return {"tune": tune, "score": score, "aborted_outcomes": aborted}


def search_summary(search: LrSearch, node: int | None = None) -> dict[str, Any]:
    """What a tuned baseline chose and scored (``node``: one node of a centralized run)."""
    chosen = search.chosen
    return {
        "lr": chosen.lr,
        "step": chosen.best_step,
        "tune": chosen.best_tune,
        "score": chosen.best_score[0 if node is None else node],
        "at_edge": search.at_edge,
        "capped": chosen.capped,
        "grid": [
            {"lr": t.lr, "step": t.best_step, "tune": t.best_tune, "last_step": t.steps[-1]}
            for t in search.trials
        ],
    }


def seed_setting(
    run: dict[str, Any], seed: int, nodes: int
) -> tuple[LensembleConfig, dict[str, Any]]:
    """The federation config and the data settings of one seed."""
    run = {**run, "lensemble.root-seed": seed, "lensemble.min-participants": nodes}
    data = {
        "trajectories": int(run["trajectories"]),
        "steps": int(run["trajectory-steps"]),
        "validation_trajectories": int(run["validation-trajectories"]),
        "actuation": str(run["actuation"]),
    }
    return LensembleConfig.from_run_config(run), data


def run_seed(run: dict[str, Any], seed: int, nodes: int, rounds: int) -> dict[str, Any]:
    """Federated and tuned local-only on one seed, each node scored on its scoring half."""
    config, data = seed_setting(run, seed, nodes)
    started = time.perf_counter()
    fed = federated(config, data, seed, nodes, rounds)
    fed_seconds = time.perf_counter() - started
    datas = [participant_data(i, seed=seed, **data) for i in range(nodes)]
    halves = data["validation_trajectories"]
    local = [search_summary(tuned_local_only(d, halves, config, init_seed=seed)) for d in datas]
    local_seconds = time.perf_counter() - started - fed_seconds
    final = {
        "federated": [c[-1] for c in fed["score"]],
        "local_only": [lo["score"] for lo in local],
    }
    wins = sum(f < lo for f, lo in zip(final["federated"], final["local_only"], strict=True))
    return {
        "final": final,
        "mean": {k: float(np.mean(v)) for k, v in final.items()},
        "wins": wins,
        "federated_curves": {"tune": fed["tune"], "score": fed["score"]},
        "local_only": local,
        "aborted_outcomes": fed["aborted_outcomes"],
        "seconds": {
            "federated": fed_seconds,
            "local_only": local_seconds,
            "all": time.perf_counter() - started,
        },
    }


def add_centralized(entry: dict[str, Any], run: dict[str, Any], seed: int, nodes: int) -> None:
    """The tuned centralized arm of one seed, into its ``run_seed`` entry."""
    config, data = seed_setting(run, seed, nodes)
    started = time.perf_counter()
    datas = [participant_data(i, seed=seed, **data) for i in range(nodes)]
    search = tuned_centralized(datas, data["validation_trajectories"], config, init_seed=seed)
    central = [search_summary(search, node=i) for i in range(nodes)]
    entry["final"]["centralized"] = [c["score"] for c in central]
    entry["mean"]["centralized"] = float(np.mean(entry["final"]["centralized"]))
    entry["centralized"] = {k: v for k, v in central[0].items() if k != "score"}
    entry["seconds"]["centralized"] = time.perf_counter() - started


def plot(results: dict[str, Any], path: Path) -> None:
    """Per seed, each node's scoring-half loss: federated against tuned local-only."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    seeds = results["per_seed"]
    fig = Figure(figsize=(3.2 * len(seeds), 3.4), layout="constrained")
    axes = fig.subplots(1, len(seeds), squeeze=False)[0]
    for ax, (seed, s) in zip(axes, seeds.items(), strict=True):
        local, fed = s["final"]["local_only"], s["final"]["federated"]
        top = 1.05 * max(*local, *fed)
        ax.plot([0, top], [0, top], color="grey", lw=0.8)
        ax.scatter(local, fed, s=14, color="tab:blue", label="a node")
        if "centralized" in s["mean"]:
            ax.axhline(s["mean"]["centralized"], color="tab:green", lw=0.8, label="centralized")
        ax.set_xlim(0, top)
        ax.set_ylim(0, top)
        ax.set_title(f"seed {seed}: federated better on {s['wins']}/{len(fed)}", fontsize=9)
        ax.set_xlabel("tuned local-only (scoring half)")
        ax.set_ylabel("federated (scoring half)")
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=110, metadata={"Software": None})


def print_seed(seed: int, s: dict[str, Any], nodes: int, rounds: int) -> None:
    took = ", ".join(f"{arm} {t:.0f} s" for arm, t in s["seconds"].items())
    print(f"\nseed {seed}, loss on each node's scoring half ({took}):")
    print("node  federated  tuned local-only (lr, step)  tuned centralized  federated better")
    central = s["final"].get("centralized", ["-"] * nodes)
    for i in range(nodes):
        f, lo, c = s["final"]["federated"][i], s["final"]["local_only"][i], central[i]
        pick = s["local_only"][i]
        chosen = f"{lo:.4f} ({pick['lr']:.4g}, {pick['step']})"
        c_text = c if isinstance(c, str) else f"{c:.4f}"
        print(f"{i:4d}  {f:9.4f}  {chosen:>27}  {c_text:>17}  {'yes' if f < lo else 'no'}")
    m = s["mean"]
    c_text = f"{m['centralized']:.4f}" if "centralized" in m else "-"
    print(
        f"mean  {m['federated']:9.4f}  {m['local_only']:27.4f}  {c_text:>17}  {s['wins']}/{nodes}"
    )
    print(f"federated: round {rounds}, untuned")
    if "centralized" in s:
        c = s["centralized"]
        print(
            f"centralized: lr {c['lr']:.4g}, step {c['step']}, at an edge or the cap: "
            f"{c['at_edge'] or c['capped']}"
        )
    edges = [i for i, p in enumerate(s["local_only"]) if p["at_edge"] or p["capped"]]
    if edges:
        print(f"local-only at a grid edge or the step cap: nodes {edges}")
    sys.stdout.flush()


def targets_of(per_seed: dict[str, Any]) -> list[dict[str, Any]]:
    targets = []
    for seed, s in per_seed.items():
        targets.append(
            {
                "target": f"seed {seed}: federated beats tuned local-only on >= {MIN_WINS} nodes",
                "value": s["wins"],
                "pass": s["wins"] >= MIN_WINS,
            }
        )
        targets.append(
            {
                "target": f"seed {seed}: no round attempt aborted",
                "value": s["aborted_outcomes"],
                "pass": s["aborted_outcomes"] == 0,
            }
        )
        targets.append(
            {
                "target": f"seed {seed}: federated mean < tuned local-only mean (ratio)",
                "value": s["mean"]["federated"] / s["mean"]["local_only"],
                "pass": s["mean"]["federated"] < s["mean"]["local_only"],
            }
        )
    return targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    parser.add_argument("--nodes", type=int, default=None, help="default: num-partitions")
    parser.add_argument("--rounds", type=int, default=None, help="default: num-server-rounds")
    parser.add_argument(
        "--centralized-seeds",
        type=int,
        nargs="*",
        default=None,
        help="the seeds that also run the tuned centralized arm, after every seed's "
        "federated and local-only arms (default: all; it costs the most)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)  # tiny models: one thread is faster, and the machine is shared
    run = main_job_settings(ROOT / "pyproject.toml")
    nodes = args.nodes or int(run["num-partitions"])
    rounds = args.rounds if args.rounds is not None else int(run["num-server-rounds"])

    started = time.perf_counter()
    per_seed: dict[str, Any] = {}
    loads: list[float] = []

    def write() -> dict[str, Any]:
        loads.append(os.getloadavg()[1])  # the 5-minute load average as a part ended
        results = {
            "command": "python benchmarks/bench_main_job.py " + " ".join(argv or sys.argv[1:]),
            "settings": {"nodes": nodes, "rounds": rounds, "seeds": args.seeds, "run_config": run},
            "per_seed": per_seed,  # written after every part: complete when all are in
            "summary": {
                "wins": [s["wins"] for s in per_seed.values()],
                "mean_gain": [
                    1 - s["mean"]["federated"] / s["mean"]["local_only"] for s in per_seed.values()
                ],
            },
            "targets": targets_of(per_seed),
            "seconds": time.perf_counter() - started,
            "load_average_5min": loads,
            "machine": {"python": platform.python_version(), "torch": torch.__version__},
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "main_job.json").write_text(json.dumps(results, indent=1) + "\n")
        return results

    for seed in args.seeds:
        per_seed[str(seed)] = run_seed(run, seed, nodes, rounds)
        results = write()
        print_seed(seed, per_seed[str(seed)], nodes, rounds)
    central = args.seeds if args.centralized_seeds is None else args.centralized_seeds
    for seed in central:
        if str(seed) in per_seed:
            add_centralized(per_seed[str(seed)], run, seed, nodes)
            results = write()
            print_seed(seed, per_seed[str(seed)], nodes, rounds)
    plot(results, args.out / "main_job.png")
    print(f"\n{len(args.seeds)} seeds in {results['seconds']:.0f} s; wrote main_job.json/png")
    print(f"nodes where federated beats tuned local-only, per seed: {results['summary']['wins']}")
    print(
        "mean gain over tuned local-only (1 - federated / local-only): "
        + ", ".join(f"{g:.3f}" for g in results["summary"]["mean_gain"])
    )
    targets = results["targets"]
    for t in targets:
        value = f"{t['value']:.3f}" if isinstance(t["value"], float) else str(t["value"])
        print(f"{'PASS' if t['pass'] else 'FAIL'}: {t['target']} ({value})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
