"""Benchmark: does lensemble's default learn as well as Flower's own strategies, tuned alike?

Run ``.venv/bin/python benchmarks/bench_learning.py`` (``--help``; ``--quick`` for a smoke
run of a minute or two). It needs the ``examples`` extra (scikit-learn's digits).

The task is the digits example's (``apps/digits``, :mod:`lensemble_flwr.simulations.digits_data`):
10 nodes, a Dirichlet(``--alpha``, default 0.5) label-skew split per seed, a 64-32-10 MLP,
accuracy and loss of the global model on the union of the nodes' held-out splits after
every round. Four arms, each driven by a Flower strategy object over the same in-process
Grid (:class:`LoopbackGrid`: instructions are answered by the nodes' ClientApps at once,
so a round costs its training and the strategy, not the simulation engine's ticks):

* ``FedAvg``: Flower's ``FedAvg``;
* ``FedAvgM``: Flower's ``FedAvgM(server_momentum=0.9, server_learning_rate=η)``;
* ``FedAdam``: Flower's ``FedAdam(eta=η)`` (its other defaults: beta 0.9/0.99, tau 1e-3);
* ``lensemble``: ``LensembleStrategy`` with lensemble's default outer step (Nesterov
  momentum 0.9, outer lr η; 0.7 is the default), updates weighted by example count as the
  digits app ships it, in plaintext rounds.

Local training is the same in every arm: ``--steps`` AdamW steps (betas 0.9/0.95, no
weight decay) of batch ``--batch`` on the node's own split. The three Flower arms run a
stock Message-API ClientApp that builds a fresh AdamW every round (as a Flower quickstart
does); lensemble's participant keeps its AdamW state between rounds (DiLoCo's inner
optimizer), which is part of what is compared.

Tuning: every arm starts from the same grid of inner learning rates (``--inner-lrs``), and
every arm with a server step (all but FedAvg) from a grid of its server learning rate
(``--fedavgm-lrs``, ``--fedadam-lrs``, ``--outer-lrs``); an arm runs every pair of the
two. Each arm is tuned twice over the same runs: its most accurate setting (best mean
final accuracy over the seeds) and its fastest (fewest rounds to ``--target``, median over
the seeds, then accuracy); the same selections for every arm, ties going to the lower
rates. Each grid must extend past each pick (``benchmarks/tuning.py``): while an arm's
inner or server rate is the smallest or largest of its grid, the next rate past it (x or /
``--extend-factor``, default 3) joins that arm's grid, paired with every rate of its other
grid, and the arm is selected again, at most ``--max-extensions`` (default 3) times per
grid and side. The final grids and picks are printed, and a pick still at an edge fails a
target. The selection and the figures are on the same seeds (in-sample). ``--reuse`` reads
an earlier run's JSON of the same task and runs only the settings it lacks (a wider grid,
another bound).

Each selected arm is reported over ``--seeds`` seeds (default 5) with the spread: final
accuracy and loss (mean, std, min, max), and rounds to reach ``--target`` accuracy (median
and range over the seeds; "-" when a seed never reaches it), then seed by seed. The
per-round accuracy of each selected arm is written with every setting run to
``benchmarks/results/learning*.json`` and plotted to the PNG beside it. A report, not a
test: the exit code is 0 whatever the outcome.

Claims it checks (printed as PASS/FAIL lines): lensemble's most accurate setting reaches
the target in no more rounds than the fastest of the Flower arms' most accurate settings
(median over seeds); its final accuracy is within one standard deviation of the most
accurate Flower arm's; lensemble's fastest setting reaches the target in no more rounds
than the fastest Flower arm's fastest; and every selected rate has grid values on both
sides of it.
"""

# ruff: noqa: E402  (Flower reads its environment when it is imported)
from __future__ import annotations

import tempfile

from own_flwr_home import use_own_flwr_home

use_own_flwr_home("bench-learning-flwr-")

import argparse
import dataclasses
import itertools
import json
import logging
import math
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from tuning import extend_until_interior  # benchmarks/tuning.py, beside this script

from lensemble_flwr.canonical import derive_seed
from lensemble_flwr.clients.app import make_client_app
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.participant.local_training import run_inner_loop
from lensemble_flwr.simulations.digits_data import (
    DigitsNet,
    DigitsTrainer,
    centralized_evaluate,
    load_partition,
)
from lensemble_flwr.strategies import LensembleStrategy
from lensemble_flwr.strategies.records import record_to_arrays

NODES = 10
BETAS = (0.9, 0.95)  # lensemble's inner AdamW betas; the stock arms use the same
RESULTS = Path(__file__).resolve().parent / "results"


# -- an in-process Grid ------------------------------------------------------------------
class LoopbackGrid(Grid):
    """A Grid whose nodes are ClientApps in this process, answering at once.

    ``push_messages`` names each message (as a SuperLink does), hands it to the
    destination node's ClientApp with that node's Context, and keeps the reply for
    ``pull_messages``. Nothing is faked in the replies: they are what the ClientApps
    returned (``Message(content, reply_to=instruction)``).
    """

    def __init__(self, apps: dict[int, tuple[ClientApp, Context]]) -> None:
        self.apps = apps
        self._replies: dict[str, Message] = {}
        self._run = Run.create_empty(run_id=1)

    def set_run(self, run_id: int) -> None:
        self._run = Run.create_empty(run_id=run_id)

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> list[int]:
        return list(self.apps)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            app, context = self.apps[message.metadata.dst_node_id]
            self._replies[message.metadata.message_id] = app(message, context)
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        return self.pull_messages(self.push_messages(messages))


def as_server_app() -> None:
    """Messages read the sending process's identity, which Flower sets when it starts a
    ServerApp; this script is the ServerApp's process, so it sets it the same way."""
    TaskIdentity._run_id = 1  # type: ignore[attr-defined]
    TaskIdentity._node_id = SUPERLINK_NODE_ID  # type: ignore[attr-defined]
    TaskIdentity._task_id = 1  # type: ignore[attr-defined]


# -- the nodes ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Setting:
    arm: str
    inner_lr: float
    server_lr: float | None  # None: FedAvg (no server step)

    @property
    def label(self) -> str:
        server = "" if self.server_lr is None else f", server lr {self.server_lr:g}"
        return f"{self.arm} (inner lr {self.inner_lr:g}{server})"


def partition(context: Context, data_seed: int, alpha: float) -> DigitsTrainer:
    part = int(context.node_config["partition-id"])
    return DigitsTrainer(load_partition(part, NODES, seed=data_seed, alpha=alpha))


def stock_app(data_seed: int, alpha: float, steps: int, batch: int) -> ClientApp:
    """A stock Message-API ClientApp: load the arrays, ``steps`` AdamW steps with a fresh
    optimizer, reply the arrays and ``num-examples``."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        trainer = partition(context, data_seed, alpha)
        trainer.model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        config = msg.content["config"]
        optimizer = torch.optim.AdamW(
            trainer.model.parameters(), lr=float(config["lr"]), betas=BETAS, weight_decay=0.0
        )
        seed = derive_seed(data_seed, "stock", int(config["server-round"]), context.node_id)
        loss = run_inner_loop(trainer, optimizer, steps=steps, seed=seed, batch_size=batch)
        metrics = MetricRecord({"train_loss": loss, "num-examples": trainer.num_examples()})
        arrays = ArrayRecord(trainer.model.state_dict())
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    return app


def lensemble_config(setting: Setting, data_seed: int, steps: int, batch: int) -> LensembleConfig:
    return LensembleConfig(
        federation={"min_participants": NODES, "weighting": "num-examples", "root_seed": data_seed},
        inner={"steps": steps, "lr": setting.inner_lr, "weight_decay": 0.0, "batch_size": batch},
        outer={"lr": setting.server_lr},
        groups={"shared": "*", "local": ""},
    )


def initial_arrays() -> ArrayRecord:
    """θ_0 as a Flower user writes it: the model's state dict, in its order (FedAvgM and
    FedAdam pair the replies' arrays with these by position)."""
    return ArrayRecord(DigitsNet(seed=0).state_dict())


def run_setting(setting: Setting, seed: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """One run: the global model's centralized accuracy and loss after every round."""
    contexts = {
        100 + i: Context(
            run_id=1,
            node_id=100 + i,
            node_config={"partition-id": i, "num-partitions": NODES},
            state=RecordDict(),
            run_config={},
        )
        for i in range(NODES)
    }
    accuracy: list[float] = []
    loss: list[float] = []

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        if server_round > 0:
            value_loss, value_acc = centralized_evaluate(
                record_to_arrays(arrays), seed=seed, num_partitions=NODES, alpha=args.alpha
            )
            accuracy.append(value_acc)
            loss.append(value_loss)
        return MetricRecord({})

    common = {"fraction_evaluate": 0.0}
    if setting.arm == "lensemble":
        config = lensemble_config(setting, seed, args.steps, args.batch)
        app = make_client_app(
            lambda context: partition(context, seed, args.alpha),
            config_fn=lambda context: config,
            identity_fn=lambda context: None,
            evaluate_fn=None,
        )
        with tempfile.TemporaryDirectory(prefix="bench-learning-") as run_dir:
            strategy = LensembleStrategy(
                config, run_dir=run_dir, durable_writes=False, **common
            )  # a simulation: its writes need not survive a power loss
            grid = LoopbackGrid({n: (app, c) for n, c in contexts.items()})
            strategy.start(
                grid, initial_arrays(), num_rounds=args.rounds, evaluate_fn=evaluate
            )
    else:
        app = stock_app(seed, args.alpha, args.steps, args.batch)
        sizes = {"min_available_nodes": NODES, "min_train_nodes": NODES}
        strategy_of: dict[str, Callable[[], Any]] = {
            "FedAvg": lambda: FedAvg(**common, **sizes),
            "FedAvgM": lambda: FedAvgM(
                **common, **sizes, server_learning_rate=setting.server_lr, server_momentum=0.9
            ),
            "FedAdam": lambda: FedAdam(**common, **sizes, eta=setting.server_lr),
        }
        grid = LoopbackGrid({n: (app, c) for n, c in contexts.items()})
        strategy_of[setting.arm]().start(
            grid=grid,
            initial_arrays=initial_arrays(),
            num_rounds=args.rounds,
            train_config=ConfigRecord({"lr": setting.inner_lr}),
            evaluate_fn=evaluate,
        )
    if len(accuracy) != args.rounds:
        raise RuntimeError(f"{setting.label}, seed {seed}: {len(accuracy)} rounds evaluated")
    return {"accuracy": accuracy, "loss": loss}


# -- the report --------------------------------------------------------------------------
def rounds_to(curve: list[float], target: float) -> int | None:
    return next((r + 1 for r, value in enumerate(curve) if value >= target), None)


def summary(runs: list[dict[str, list[float]]], target: float) -> dict[str, Any]:
    final = [r["accuracy"][-1] for r in runs]
    final_loss = [r["loss"][-1] for r in runs]
    reached = [rounds_to(r["accuracy"], target) for r in runs]
    hits = sorted(x for x in reached if x is not None)
    return {
        "final_accuracy": {
            "mean": statistics.fmean(final),
            "std": statistics.pstdev(final),
            "min": min(final),
            "max": max(final),
        },
        "final_loss": {"mean": statistics.fmean(final_loss), "std": statistics.pstdev(final_loss)},
        "rounds_to_target": reached,
        # a seed that never reaches the target counts as never (the median is then
        # None once half the seeds miss it)
        "median_rounds_to_target": (
            statistics.median([x if x is not None else float("inf") for x in reached])
            if len(hits) * 2 > len(reached) or len(hits) == len(reached)
            else None
        ),
    }


def fmt_rounds(value: float | None) -> str:
    return "-" if value is None or value == float("inf") else f"{value:g}"


def server_grids(args: argparse.Namespace) -> dict[str, list[float] | None]:
    """Each arm's grid of server learning rates; None for FedAvg (it has no server step)."""
    server: dict[str, list[float] | None] = {
        "FedAvg": None,
        "FedAvgM": args.fedavgm_lrs,
        "FedAdam": args.fedadam_lrs,
        "lensemble": args.outer_lrs,
    }
    return {arm: server[arm] for arm in args.arms}


def tune_arms(
    inner_lrs: list[float],
    server_lrs: dict[str, list[float] | None],
    score: Callable[[Setting], tuple[float, ...]],
    *,
    factor: float,
    max_steps: int,
) -> dict[str, Any]:
    """Each arm's setting with the highest ``score`` (a tuple, compared in order; NaN
    lowest; ties to the lower rates)
    over every pair of its inner and server grids (``server_lrs``: arm -> grid, None for
    no server step), every grid extended past its pick (:func:`extend_until_interior`):
    a rate added to one of an arm's grids is paired with every rate of the other.
    ``score`` runs a setting the first time it is asked (the caller keeps the runs).
    Returns the selected settings, the final grids and picks (keyed "<arm> inner" and
    "<arm> server"), whether each pick has grid values on both sides, and the extensions."""
    axes: dict[str, dict[str, list[Any]]] = {}
    for arm, lrs in server_lrs.items():
        server = [None] if lrs is None else sorted(set(lrs))
        axes[arm] = {"inner": sorted(set(inner_lrs)), "server": server}
    grids = {f"{arm} {axis}": list(values) for arm, by in axes.items()
             for axis, values in by.items() if values != [None]}  # fmt: skip

    def key(setting: Setting) -> tuple[float, ...]:
        return tuple(-math.inf if math.isnan(v) else v for v in score(setting))

    def best(arm: str) -> Setting:
        pairs = itertools.product(axes[arm]["inner"], axes[arm]["server"])
        return max((Setting(arm, inner, server) for inner, server in pairs), key=key)

    def pick() -> dict[str, float]:
        picks: dict[str, float] = {}
        for arm in axes:
            chosen = best(arm)
            picks[f"{arm} inner"] = chosen.inner_lr
            if chosen.server_lr is not None:
                picks[f"{arm} server"] = chosen.server_lr
        return picks

    def run(name: str, value: float) -> None:
        arm, axis = name.rsplit(" ", 1)
        axes[arm][axis] = sorted([*axes[arm][axis], value])  # best() pairs it and runs it

    grid = extend_until_interior(grids, run, pick, factor=factor, max_steps=max_steps)
    return {"selected": {arm: best(arm) for arm in axes}, **grid}


def accuracy_score(entry: dict[str, Any]) -> tuple[float, ...]:
    """A setting's score when it is selected for accuracy: its mean final accuracy."""
    return (float(entry["final_accuracy"]["mean"]),)


def rounds_score(entry: dict[str, Any]) -> tuple[float, ...]:
    """A setting's score when it is selected for speed: minus its median rounds to the
    target (fewer is better; a median that never reaches it scores lowest), then its mean
    final accuracy (among settings as fast, or none reaching the target, the more accurate)."""
    median = entry["median_rounds_to_target"]
    return (-math.inf if median is None else -float(median), *accuracy_score(entry))


def edge_verdict(tuned: dict[str, Any], selection: str) -> str:
    """The PASS/FAIL line of the target that every pick of one selection (by accuracy, by
    rounds) has grid values on both sides."""
    edge = [name for name, inside in tuned["interior"].items() if not inside]
    return (
        f"{'FAIL' if edge else 'PASS'}: every rate selected {selection} has grid values on "
        "both sides of it" + (f"; still at an edge: {', '.join(edge)}" if edge else "")
    )


def reused_results(path: Path, task: dict[str, Any]) -> dict[Setting, dict[str, Any]]:
    """The settings already run by an earlier run of the same task (its JSON), so that a
    run with other grids or bounds runs only what is new."""
    payload = json.loads(path.read_text())
    if payload.get("task") != task:
        raise ConfigError("reuse", f"{path.name} ran {payload.get('task')}, not {task}")
    return {Setting(r["arm"], r["inner_lr"], r["server_lr"]): r for r in payload["results"]}


def plot(path: Path, selected: dict[str, dict[str, Any]], target: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for chosen in selected.values():
        curves = np.array([run["accuracy"] for run in chosen["runs"]])
        rounds = np.arange(1, curves.shape[1] + 1)
        mean = curves.mean(axis=0)
        (line,) = ax.plot(rounds, mean, label=chosen["label"])
        ax.fill_between(rounds, curves.min(axis=0), curves.max(axis=0), alpha=0.15,
                        color=line.get_color())  # fmt: skip
    ax.axhline(target, color="grey", linestyle=":", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy of the global model (held-out union)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="local AdamW steps per round")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--alpha", type=float, default=0.5, help="Dirichlet label skew")
    parser.add_argument("--target", type=float, default=0.9, help="accuracy to reach")
    parser.add_argument("--inner-lrs", type=float, nargs="+", default=[1e-2, 3e-2, 1e-1])
    parser.add_argument("--fedavgm-lrs", type=float, nargs="+", default=[0.1, 0.3, 1.0])
    parser.add_argument("--fedadam-lrs", type=float, nargs="+", default=[0.03, 0.1, 0.3])
    parser.add_argument("--outer-lrs", type=float, nargs="+", default=[0.1, 0.3, 0.7])
    parser.add_argument(
        "--extend-factor", type=float, default=3.0,
        help="a pick at an edge of its grid adds the edge x or / this (default 3)",
    )  # fmt: skip
    parser.add_argument(
        "--max-extensions", type=int, default=3,
        help="at most this many rates added per grid and side (default 3)",
    )  # fmt: skip
    parser.add_argument(
        "--arms", nargs="+", default=["FedAvg", "FedAvgM", "FedAdam", "lensemble"],
        choices=["FedAvg", "FedAvgM", "FedAdam", "lensemble"],
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="2 seeds, 10 rounds, 2 inner lrs")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: results/)")
    parser.add_argument(
        "--reuse", type=Path, default=None,
        help="a JSON of an earlier run of the same task: its settings are not run again",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.rounds, args.inner_lrs = 2, 10, [1e-2, 3e-2]
    return args


def print_tuning(tuned: dict[str, Any], selection: str) -> None:
    print(f"\nfinal grids and picks, selected {selection}:")
    for name, grid in tuned["grids"].items():
        where = "inside" if tuned["interior"][name] else "AT THE EDGE of"
        values = [float(f"{v:g}") for v in grid]
        print(f"  {name:<16} {values}, pick {tuned['picks'][name]:g} ({where} the grid)")


def print_selected(
    selected: dict[str, dict[str, Any]], args: argparse.Namespace, selection: str
) -> None:
    """The selected setting of every arm: the summary, then seed by seed."""
    print(f"\nselected per arm ({selection}, over {args.seeds} seeds):")
    print(f"  {'arm':<46} {'final acc mean ± std':>21} {'[min, max]':>15} "
          f"{'final loss':>11} {'rounds to target (median)':>26}")  # fmt: skip
    for chosen in selected.values():
        acc, lossv = chosen["final_accuracy"], chosen["final_loss"]
        print(
            f"  {chosen['label']:<46} {acc['mean']:>13.3f} ± {acc['std']:.3f} "
            f"[{acc['min']:.3f}, {acc['max']:.3f}] {lossv['mean']:>11.3f} "
            f"{fmt_rounds(chosen['median_rounds_to_target']):>26}"
        )
    print(f"\nseed by seed: final accuracy (rounds to {args.target:g})")
    print(f"  {'arm':<12}" + "".join(f"{'seed ' + str(s):>16}" for s in range(args.seeds)))
    for arm, chosen in selected.items():
        cells = [
            f"{run['accuracy'][-1]:.3f} ({fmt_rounds(reached)})"
            for run, reached in zip(chosen["runs"], chosen["rounds_to_target"], strict=True)
        ]
        print(f"  {arm:<12}" + "".join(f"{c:>16}" for c in cells))


def claims(
    selected: dict[str, dict[str, Any]], fastest: dict[str, dict[str, Any]], target: float
) -> list[str]:
    """The PASS/FAIL lines of the rounds and accuracy claims, at each arm's most accurate
    setting (``selected``), and of the rounds claim at each arm's fastest (none without
    lensemble and a Flower arm)."""
    flower = {a: s for a, s in selected.items() if a != "lensemble"}
    if "lensemble" not in selected or not flower:
        return []
    quick = {a: s for a, s in fastest.items() if a != "lensemble"}
    quickest = max(quick.values(), key=rounds_score)
    lq, fq = -rounds_score(fastest["lensemble"])[0], -rounds_score(quickest)[0]
    lens = selected["lensemble"]
    best_acc = max(flower.values(), key=lambda s: s["final_accuracy"]["mean"])
    inf = float("inf")
    best_rounds = min(
        flower.values(),
        key=lambda s: s["median_rounds_to_target"] if s["median_rounds_to_target"] else inf,
    )
    lr = lens["median_rounds_to_target"] or inf
    br = best_rounds["median_rounds_to_target"] or inf
    gap = best_acc["final_accuracy"]["mean"] - lens["final_accuracy"]["mean"]
    spread = best_acc["final_accuracy"]["std"]
    return [
        f"{'PASS' if lr <= br else 'FAIL'}: rounds to {target:g} (median over seeds): "
        f"lensemble {fmt_rounds(lr)} vs the fastest tuned Flower arm, "
        f"{best_rounds['label']}, {fmt_rounds(br)}",
        f"{'PASS' if gap <= spread else 'FAIL'}: final accuracy: lensemble "
        f"{lens['final_accuracy']['mean']:.3f} vs the best tuned Flower arm, "
        f"{best_acc['label']}, {best_acc['final_accuracy']['mean']:.3f} ± {spread:.3f}",
        f"{'PASS' if lq <= fq else 'FAIL'}: rounds to {target:g}, each arm at its fastest "
        f"setting: {fastest['lensemble']['label']} {fmt_rounds(lq)} vs the fastest Flower arm, "
        f"{quickest['label']}, {fmt_rounds(fq)}",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    as_server_app()
    torch.set_num_threads(1)
    task = {"nodes": NODES, "alpha": args.alpha, "rounds": args.rounds, "steps": args.steps,
            "batch": args.batch, "seeds": args.seeds, "target": args.target}  # fmt: skip
    results = reused_results(args.reuse, task) if args.reuse else {}
    reused = len(results)
    print(
        f"== learning on digits: {NODES} nodes, Dirichlet alpha {args.alpha:g}, "
        f"{args.rounds} rounds, {args.steps} AdamW steps of {args.batch} per round, "
        f"{args.seeds} seeds; grids extend past their picks (x or / {args.extend_factor:g}, "
        f"at most {args.max_extensions} a side); {len(results)} settings reused; "
        f"torch {torch.__version__}",
        flush=True,
    )
    t0 = time.perf_counter()

    def ensure(setting: Setting) -> dict[str, Any]:
        if setting not in results:
            started = time.perf_counter()
            runs = [run_setting(setting, seed, args) for seed in range(args.seeds)]
            entry = {**dataclasses.asdict(setting), "label": setting.label, "runs": runs,
                     **summary(runs, args.target)}  # fmt: skip
            results[setting] = entry
            acc = entry["final_accuracy"]
            print(
                f"  {setting.label:<46} final accuracy {acc['mean']:.3f} ± {acc['std']:.3f} "
                f"(min {acc['min']:.3f}), rounds to {args.target:g}: "
                f"{fmt_rounds(entry['median_rounds_to_target'])} "
                f"[{', '.join(fmt_rounds(r) for r in entry['rounds_to_target'])}] "
                f"({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
        return results[setting]

    scores = {
        "by mean final accuracy": lambda s: accuracy_score(ensure(s)),
        "by fewest rounds to the target": lambda s: rounds_score(ensure(s)),
    }
    tunings = {
        selection: tune_arms(args.inner_lrs, server_grids(args), score,
                             factor=args.extend_factor, max_steps=args.max_extensions)
        for selection, score in scores.items()
    }  # fmt: skip
    picked = {}
    for selection, tuned in tunings.items():
        print_tuning(tuned, selection)
        picked[selection] = {arm: results[s] for arm, s in tuned["selected"].items()}
        print_selected(picked[selection], args, selection)
    selected, fastest = picked.values()
    verdicts = claims(selected, fastest, args.target)
    verdicts += [edge_verdict(tuned, selection) for selection, tuned in tunings.items()]
    print(f"\n{len(results)} settings in all")
    for line in verdicts:
        print(line)
    out = args.out or RESULTS / ("learning-quick.json" if args.quick else "learning.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    initial = {"inner_lrs": args.inner_lrs}
    initial |= {f"{arm}_lrs": grid for arm, grid in server_grids(args).items()}
    payload = {
        "task": task,
        "grid": {"initial": initial, "factor": args.extend_factor,
                 "max_extensions": args.max_extensions},
        "tuning": {selection: {k: tuned[k] for k in ("grids", "picks", "interior", "extensions")}
                   for selection, tuned in tunings.items()},
        "results": list(results.values()),
        "reused": reused,  # settings read from --reuse; "seconds" is this run's time only
        "selected": {arm: s["label"] for arm, s in selected.items()},
        "fastest": {arm: s["label"] for arm, s in fastest.items()},
        "verdicts": verdicts,
        "seconds": time.perf_counter() - t0,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }  # fmt: skip
    out.write_text(json.dumps(payload, indent=1) + "\n")
    plot(out.with_suffix(".png"), selected, args.target,
         f"digits, {NODES} nodes, alpha {args.alpha:g}: each arm at its most accurate "
         f"setting; band = min..max over {args.seeds} seeds")  # fmt: skip
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
