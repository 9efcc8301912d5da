"""Benchmark: does federating pay in the main job? Federated vs local-only vs centralized.

Run ``python benchmarks/bench_main_job.py`` (``--help`` for the settings). It reads the
main job's settings from the repository's ``pyproject.toml`` (``[tool.flwr.app.config]``:
rounds, partitions, data keys, and the ``lensemble`` table through
``LensembleConfig.from_run_config``, as the ServerApp and ClientApps do) and runs, per
seed (``data-seed`` = ``init-seed`` = ``root-seed`` = the seed):

* **federated**: the in-process runtime (a Coordinator and the world-model Participants
  on an InProcessNetwork with a simulated clock, :func:`build_world`), with the release
  path of the main job (alignment on the pinned probe, DiLoCo outer step, local action
  heads). It is the code ``./dev.sh main`` runs on every node and in the strategy, minus
  Flower's message transport; every node joins every round;
* **local-only**: each node alone, the same number of AdamW steps
  (``rounds × inner-steps``), :func:`world_baselines.local_only` (what the main job prints
  as ``local-only-val-loss``);
* **centralized**: one encoder and predictor, a head per node, batches from every node,
  the same number of steps, :func:`world_baselines.centralized`.

Measure: each node's validation loss (global shared weights with its own head) after the
last round. Targets, on every seed:
  1. federated beats local-only on at least 8 of the nodes (of 10);
  2. federated beats local-only on the mean over nodes.
Writes ``benchmarks/results/main_job.json`` and ``benchmarks/results/main_job.png`` and
prints the per-node table and one PASS/FAIL line per target and seed. A report, not a
test: the exit code is 0 whatever the outcome.
"""

from __future__ import annotations

import argparse
import json
import logging
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
from lensemble_flwr.simulations.world_baselines import centralized, local_only
from lensemble_flwr.simulations.world_data import participant_data
from lensemble_flwr.simulations.world_federation import build_world

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
MIN_WINS = 8


def main_job_settings(pyproject: Path) -> dict[str, Any]:
    """The main job's run config, flattened as Flower hands it to the apps."""
    table = tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"]
    flat = {k: v for k, v in table.items() if k != "lensemble"}
    flat.update({f"lensemble.{k}": v for k, v in table["lensemble"].items()})
    return flat


def run_seed(run: dict[str, Any], seed: int, nodes: int, rounds: int) -> dict[str, Any]:
    """The three arms on one seed: per node, the validation loss after every round."""
    run = {**run, "lensemble.root-seed": seed, "lensemble.min-participants": nodes}
    config = LensembleConfig.from_run_config(run)
    data = {
        "trajectories": int(run["trajectories"]),
        "steps": int(run["trajectory-steps"]),
        "validation_trajectories": int(run["validation-trajectories"]),
        "actuation": str(run["actuation"]),
    }
    started = time.perf_counter()
    fed_curves: list[list[float]] = [[] for _ in range(nodes)]
    with tempfile.TemporaryDirectory(prefix="bench-main-job-") as run_dir:
        fed = build_world(
            config,
            Path(run_dir) / "run",
            participants=nodes,
            data_seed=seed,
            init_seed=seed,
            **data,
        )

        def record() -> None:
            params = fed.coordinator.global_state().params
            for i, trainer in enumerate(fed.trainers):
                fed_curves[i].append(trainer.validation_loss(params))

        record()
        aborted = 0
        for _ in range(rounds):
            seen = len(fed.coordinator.outcomes)
            fed.coordinator.run(1)
            new = fed.coordinator.outcomes[seen:]  # the latest only are kept
            aborted += sum(o.state is RoundState.ABORTED for o in new)
            record()
    fed_seconds = time.perf_counter() - started
    datas = [participant_data(i, seed=seed, **data) for i in range(nodes)]
    local = local_only(datas, config, rounds=rounds, init_seed=seed)
    central = centralized(datas, config, rounds=rounds, init_seed=seed)
    final = {
        "federated": [c[-1] for c in fed_curves],
        "local_only": [c[-1] for c in local.validation],
        "centralized": [c[-1] for c in central.validation],
    }
    wins = sum(f < lo for f, lo in zip(final["federated"], final["local_only"], strict=True))
    return {
        "final": final,
        "mean": {k: float(np.mean(v)) for k, v in final.items()},
        "wins": wins,
        "curves": {
            "federated": fed_curves,
            "local_only": local.validation,
            "centralized": central.validation,
        },
        "aborted_outcomes": aborted,
        "federated_seconds": fed_seconds,
        "seconds": time.perf_counter() - started,
    }


def plot(results: dict[str, Any], path: Path) -> None:
    """Mean validation loss per round of the three arms, one panel per seed."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    seeds = results["per_seed"]
    fig = Figure(figsize=(4.0 * len(seeds), 3.4), layout="constrained")
    axes = fig.subplots(1, len(seeds), squeeze=False)[0]
    colors = {"federated": "tab:blue", "local_only": "tab:orange", "centralized": "tab:green"}
    for ax, (seed, s) in zip(axes, seeds.items(), strict=True):
        for arm, curves in s["curves"].items():
            mean = np.mean(np.array(curves), axis=0)
            ax.plot(range(len(mean)), mean, color=colors[arm], label=arm.replace("_", "-"))
        ax.set_title(f"seed {seed}: federated beats local-only on {s['wins']}/10", fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel("validation loss (mean over nodes)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=110, metadata={"Software": None})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--nodes", type=int, default=None, help="default: num-partitions")
    parser.add_argument("--rounds", type=int, default=None, help="default: num-server-rounds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)  # tiny models: one thread is faster, and the machine is shared
    run = main_job_settings(ROOT / "pyproject.toml")
    nodes = args.nodes or int(run["num-partitions"])
    rounds = args.rounds if args.rounds is not None else int(run["num-server-rounds"])

    started = time.perf_counter()
    per_seed = {}
    for seed in args.seeds:
        per_seed[str(seed)] = s = run_seed(run, seed, nodes, rounds)
        print(f"\nseed {seed} ({s['seconds']:.0f} s), validation loss after round {rounds}:")
        print("node  federated  local-only  centralized  federated better")
        for i in range(nodes):
            f, lo, c = (s["final"][k][i] for k in ("federated", "local_only", "centralized"))
            print(f"{i:4d}  {f:9.4f}  {lo:10.4f}  {c:11.4f}  {'yes' if f < lo else 'no'}")
        m = s["mean"]
        print(
            f"mean  {m['federated']:9.4f}  {m['local_only']:10.4f}  {m['centralized']:11.4f}"
            f"  {s['wins']}/{nodes}",
            flush=True,
        )
    targets = []
    for seed, s in per_seed.items():
        targets.append(
            {
                "target": f"seed {seed}: federated beats local-only on >= {MIN_WINS} nodes",
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
                "target": f"seed {seed}: federated mean < local-only mean (ratio)",
                "value": s["mean"]["federated"] / s["mean"]["local_only"],
                "pass": s["mean"]["federated"] < s["mean"]["local_only"],
            }
        )
    results = {
        "command": "python benchmarks/bench_main_job.py " + " ".join(argv or sys.argv[1:]),
        "settings": {"nodes": nodes, "rounds": rounds, "seeds": args.seeds, "run_config": run},
        "per_seed": per_seed,
        "targets": targets,
        "seconds": time.perf_counter() - started,
        "machine": {"python": platform.python_version(), "torch": torch.__version__},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "main_job.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out / "main_job.png")
    print(f"\n{len(args.seeds)} seeds in {results['seconds']:.0f} s; wrote main_job.json/png")
    for t in targets:
        value = f"{t['value']:.3f}" if isinstance(t["value"], float) else str(t["value"])
        print(f"{'PASS' if t['pass'] else 'FAIL'}: {t['target']} ({value})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
