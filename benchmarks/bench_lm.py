"""Benchmark: DiLoCo against synchronous data-parallel training on the byte LM (apps/lm).

Run ``.venv/bin/python benchmarks/bench_lm.py`` (``--help``; ``--quick`` for a smoke run
of about a minute). Nothing is downloaded: the data is the running interpreter's standard
library, split as the app splits it (:mod:`lensemble_flwr.simulations.lm_data`, data seed 0:
whole packages per node, 20 % of each node's files held out, the package ``re`` held out
from every node).

Four arms, at equal compute and equal tokens: every node takes ``--steps`` inner AdamW
steps (the app's inner optimizer: lr 3e-3, betas 0.9/0.95, no weight decay, a constant
learning rate) on batches of ``--batch`` random windows of its own training text, from the
same initial model (``ByteLM`` of ``--d-model``/``--layers``, the seed's weights):

* ``diloco``: lensemble's Coordinator and Participants in one process
  (:func:`lensemble_flwr.simulations.inprocess.build`, each node an ``LmTraining``), with
  the lm app's lensemble settings (``apps/lm/pyproject.toml``) and DiLoCo's outer step
  (lensemble's default; the app itself now ships plain averaging): Nesterov, outer lr
  0.7, momentum 0.9; a round is H inner steps per node, the updates
  weighted by the nodes' window counts (``weighting = "num-examples"``). Each node's
  AdamW state persists across rounds (DiLoCo's inner optimizer).
* ``fedavg``: the same code with outer lr 1 and momentum 0, so that the new global model
  is the weighted mean of the nodes' models (FedAvg with persistent inner AdamW state).
* ``sync``: synchronous data-parallel training, a plain torch loop: one model, one AdamW;
  every step each node's batch loss is back-propagated with the node's weight (the same
  weights as the outer step) into one gradient, i.e. the weighted mean of the nodes'
  gradients, then one AdamW step. One exchange per step (H = 1).
* ``local``: every node trains its own model from the same initial weights and never
  communicates; measured as the mean over the nodes of each node's own model.

Measured after every round (every ``--eval-every`` steps for ``sync`` and ``local``), in
bits per byte: the model on the nodes' held-out files (the mean over the nodes, each
node's own files) and on the held-out package. The rounds a run communicated and the
inner steps each node took are counted as they happen (they are not computed from the
settings). Prints a table of the final values over the seeds, writes
``benchmarks/results/lm.json`` and ``lm.png`` (bits per byte against communication rounds
and against inner steps). A report, not a test: the exit code is 0 whatever the outcome.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lensemble_flwr.canonical import derive_seed
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.coordinator import RoundOutcome
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.participant.local_training import deterministic_algorithms, inner_adamw
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.simulations.inprocess import build
from lensemble_flwr.simulations.lm_data import (
    CorpusSettings,
    NodeCorpus,
    as_bytes,
    evaluation_windows,
    held_out_files,
    node_corpus,
    split_packages,
)
from lensemble_flwr.simulations.lm_model import ByteLM, ModelShape, evaluate_bits_per_byte
from lensemble_flwr.simulations.lm_training import LmTrainer, LmTraining

if sys.version_info >= (3, 11):
    import tomllib
else:  # Flower depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
APP_PYPROJECT = ROOT / "apps" / "lm" / "pyproject.toml"
ARMS = ("diloco", "fedavg", "sync", "local")
OUTER = {"diloco": (0.7, 0.9), "fedavg": (1.0, 0.0)}  # (outer lr, momentum)
LABELS = {
    "diloco": "DiLoCo (outer Nesterov lr 0.7, momentum 0.9)",
    "fedavg": "FedAvg (outer lr 1, momentum 0)",
    "sync": "synchronous data-parallel (H = 1)",
    "local": "local-only",
}


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every arm of one comparison shares."""

    nodes: int = 4
    steps: int = 300  # inner steps per node (T): every arm's compute
    batch: int = 8  # windows per node per step
    shape: ModelShape = dataclasses.field(
        default_factory=lambda: ModelShape(d_model=64, layers=2, heads=4, seq_len=64)
    )
    node_eval_bytes: int = 2048  # about how many bytes of each node's held-out files
    held_out_eval_bytes: int = 4096  # and of the held-out package
    eval_every: int = 10  # steps between measures of sync and local
    data_seed: int = 0
    max_file_bytes: int = 32768
    max_package_bytes: int = 262144

    @property
    def corpus(self) -> CorpusSettings:
        return CorpusSettings(
            num_nodes=self.nodes,
            seed=self.data_seed,
            max_file_bytes=self.max_file_bytes,
            max_package_bytes=self.max_package_bytes,
        )


@dataclasses.dataclass
class Data:
    """The split, read once: each node's files and the held-out package's windows."""

    corpora: list[NodeCorpus]
    held_out: torch.Tensor
    held_out_name: str

    @classmethod
    def of(cls, setup: Setup) -> Data:
        settings = setup.corpus
        windows = evaluation_windows(
            as_bytes(held_out_files(settings)), setup.shape.seq_len, setup.held_out_eval_bytes
        )
        corpora = [node_corpus(i, settings) for i in range(setup.nodes)]
        return cls(corpora, windows, split_packages(settings).held_out)


@dataclasses.dataclass
class Point:
    """One measure: inner steps per node so far, exchanges so far, bits per byte."""

    step: int
    rounds: int
    nodes_bpb: float  # mean over the nodes of the model(s) on each node's held-out files
    held_out_bpb: float  # the model (local: the mean of the nodes' models) on the package


@dataclasses.dataclass
class Result:
    arm: str
    h: int | None  # None: the arm has no H (sync exchanges every step, local never)
    seed: int
    curve: list[Point]
    steps_per_node: list[int]  # counted as the nodes drew their batches
    rounds: int  # counted exchanges: closed rounds, or gradient averages
    seconds: float


class CountingTrainer(LmTrainer):
    """An ``LmTrainer`` that counts its batches: one per inner step."""

    batches_drawn = 0

    def sample_batch(self, generator: torch.Generator, batch_size: int) -> Any:
        self.batches_drawn += 1
        return super().sample_batch(generator, batch_size)


class RecordingTraining(LmTraining):
    """``LmTraining`` that keeps the params of its last fit (what it released from)."""

    last_fit: NamedArrays | None = None

    def fit(self, global_params: Any, *, steps: int, seed: int) -> NamedArrays:
        self.last_fit = super().fit(global_params, steps=steps, seed=seed)
        return self.last_fit


def trainers_of(setup: Setup, data: Data, seed: int) -> list[CountingTrainer]:
    return [
        CountingTrainer(c, setup.shape, init_seed=seed, eval_bytes=setup.node_eval_bytes)
        for c in data.corpora
    ]


def node_weights(trainers: Sequence[LmTrainer]) -> list[float]:
    """The outer step's weights (``weighting = "num-examples"``): each node's window count."""
    counts = [t.num_examples() for t in trainers]
    return [c / sum(counts) for c in counts]


class Meter:
    """Bits per byte of given params on every node's held-out files and on the package."""

    def __init__(self, setup: Setup, data: Data, trainers: Sequence[LmTrainer]) -> None:
        self.model = ByteLM(setup.shape).to(trainers[0].device)
        self.validation = [t.validation for t in trainers]
        self.held_out = data.held_out

    def load(self, params: NamedArrays) -> torch.nn.Module:
        state = {n: torch.from_numpy(np.asarray(a)) for n, a in params.items()}
        self.model.load_state_dict(state)
        return self.model

    def point(self, step: int, rounds: int, params: NamedArrays) -> Point:
        model = self.load(params)
        nodes = statistics.fmean(evaluate_bits_per_byte(model, w) for w in self.validation)
        return Point(step, rounds, nodes, evaluate_bits_per_byte(model, self.held_out))


def app_lensemble_keys() -> dict[str, Any]:
    """The lm app's lensemble table (``apps/lm/pyproject.toml``), as ``lensemble.`` keys."""
    table = tomllib.loads(APP_PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    return {f"lensemble.{k}": v for k, v in table["lensemble"].items()}


def federated_config(setup: Setup, arm: str, h: int, seed: int) -> LensembleConfig:
    """The app's lensemble settings with this comparison's nodes, H, seed and outer step."""
    lr, momentum = OUTER[arm]
    keys = app_lensemble_keys() | {
        "lensemble.min-participants": setup.nodes,
        "lensemble.inner-steps": h,
        "lensemble.inner-batch-size": setup.batch,
        "lensemble.root-seed": seed,
        "lensemble.outer-lr": lr,
        "lensemble.outer-momentum": momentum,
        "lensemble.deadline-mode": "fixed",  # a simulated clock: no round times to follow
    }
    return LensembleConfig.from_run_config(keys)


Observer = Callable[[int, NamedArrays, NamedArrays, list[NamedArrays], list[float]], None]


def run_federated(
    setup: Setup, data: Data, arm: str, h: int, seed: int, observe: Observer | None = None
) -> Result:
    """``diloco`` or ``fedavg``: lensemble's Coordinator and Participants for ``steps / h``
    rounds. ``observe(round, before, after, node_params, weights)`` sees every closed
    round: the global params before and after it, each node's trained params, and the
    nodes' weights."""
    if setup.steps % h:
        raise ValueError(f"--steps {setup.steps} is not a multiple of H = {h}")
    config = federated_config(setup, arm, h, seed)
    trainers = trainers_of(setup, data, seed)
    trainings = [RecordingTraining(t, config, local_only=False) for t in trainers]
    meter = Meter(setup, data, trainers)
    initial = {
        n: t.detach().cpu().numpy().copy()
        for n, t in ByteLM(setup.shape, seed=seed).state_dict().items()
    }
    curve = [meter.point(0, 0, initial)]
    weights = node_weights(trainers)
    before: list[NamedArrays] = [initial]
    closed = 0

    def on_round(outcome: RoundOutcome) -> None:
        nonlocal closed
        if outcome.state is not RoundState.CLOSED:
            raise RuntimeError(f"{arm} H={h} seed {seed}: round {outcome.round} did not close")
        closed += 1
        params = {n: np.array(a, copy=True) for n, a in coordinator.global_state().params.items()}
        if observe is not None:
            nodes = [dict(t.last_fit or {}) for t in trainings]
            observe(outcome.round, before[0], params, nodes, weights)
        before[0] = params
        curve.append(meter.point(outcome.round * h, closed, params))

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-lm-") as run_dir:
        coordinator, _network, _nodes = build(
            config,
            Path(run_dir) / "run",
            participants=setup.nodes,
            on_round=on_round,
            trainer_of=lambda i: trainings[i],
            params=initial,
        )
        coordinator.run(setup.steps // h)
    return Result(
        arm, h, seed, curve, [t.batches_drawn for t in trainers], closed,
        time.perf_counter() - started,
    )  # fmt: skip


def params_of(model: torch.nn.Module) -> NamedArrays:
    return {n: t.detach().cpu().numpy().copy() for n, t in model.state_dict().items()}


def run_sync(
    setup: Setup, data: Data, seed: int, observe: Callable[[int, torch.Tensor], None] | None = None
) -> Result:
    """``sync``: one model; every step the weighted mean of the nodes' gradients, each on
    its node's own batch, then one AdamW step. ``observe(step, gradient)`` sees the
    gradient each step takes (flattened), just before the AdamW step."""
    config = federated_config(setup, "diloco", 1, seed)  # only its inner settings are used
    trainers = trainers_of(setup, data, seed)
    weights = node_weights(trainers)
    meter = Meter(setup, data, trainers)
    model = ByteLM(setup.shape, seed=seed).to(trainers[0].device)
    optimizer = inner_adamw(model.parameters(), config)
    generators = [torch.Generator().manual_seed(derive_seed(seed, "bench-lm-sync", i))
                  for i in range(setup.nodes)]  # fmt: skip
    curve = [meter.point(0, 0, params_of(model))]
    exchanges = 0
    started = time.perf_counter()
    torch.random.default_generator.manual_seed(seed)
    for step in range(1, setup.steps + 1):
        model.train()
        optimizer.zero_grad(set_to_none=True)
        with deterministic_algorithms(config.inner.deterministic):
            for trainer, generator, weight in zip(trainers, generators, weights, strict=True):
                batch = trainer.sample_batch(generator, setup.batch)
                (weight * trainer.loss(model, batch)).backward()  # accumulates Σ w_i g_i
            if observe is not None:
                observe(step, torch.cat([p.grad.flatten() for p in model.parameters()]))
            optimizer.step()
        exchanges += 1  # the nodes' gradients met once this step
        if step % setup.eval_every == 0 or step == setup.steps:
            curve.append(meter.point(step, exchanges, params_of(model)))
    return Result("sync", None, seed, curve, [t.batches_drawn for t in trainers], exchanges,
                  time.perf_counter() - started)  # fmt: skip


def run_local(setup: Setup, data: Data, seed: int) -> Result:
    """``local``: each node trains its own model alone; the measure is the mean over the
    nodes of each node's model (on its own held-out files, and on the package)."""
    config = federated_config(setup, "diloco", 1, seed)
    trainers = trainers_of(setup, data, seed)
    meters = [Meter(setup, data, [t]) for t in trainers]
    optimizers = [inner_adamw(t.model.parameters(), config) for t in trainers]
    generators = [torch.Generator().manual_seed(derive_seed(seed, "bench-lm-local", i))
                  for i in range(setup.nodes)]  # fmt: skip

    def point(step: int) -> Point:
        points = [
            m.point(step, 0, params_of(t.model)) for m, t in zip(meters, trainers, strict=True)
        ]
        return Point(step, 0, statistics.fmean(p.nodes_bpb for p in points),
                     statistics.fmean(p.held_out_bpb for p in points))  # fmt: skip

    curve = [point(0)]
    started = time.perf_counter()
    torch.random.default_generator.manual_seed(seed)
    for step in range(1, setup.steps + 1):
        with deterministic_algorithms(config.inner.deterministic):
            for trainer, generator, optimizer in zip(trainers, generators, optimizers, strict=True):
                trainer.model.train()
                batch = trainer.sample_batch(generator, setup.batch)
                optimizer.zero_grad(set_to_none=True)
                trainer.loss(trainer.model, batch).backward()
                optimizer.step()
        if step % setup.eval_every == 0 or step == setup.steps:
            curve.append(point(step))
    return Result("local", None, seed, curve, [t.batches_drawn for t in trainers], 0,
                  time.perf_counter() - started)  # fmt: skip


def run_arm(setup: Setup, data: Data, arm: str, h: int | None, seed: int) -> Result:
    if arm in OUTER:
        assert h is not None
        return run_federated(setup, data, arm, h, seed)
    return run_sync(setup, data, seed) if arm == "sync" else run_local(setup, data, seed)


# -- the report --------------------------------------------------------------------------
def stats(values: Sequence[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values),
        "min": min(values),
        "max": max(values),
    }


def summarise(results: Sequence[Result]) -> list[dict[str, Any]]:
    """One row per (arm, H): final bits per byte over the seeds, the exchanges, the steps."""
    rows: list[dict[str, Any]] = []
    keys = list(dict.fromkeys((r.arm, r.h) for r in results))
    sync = [r for r in results if r.arm == "sync"]
    sync_rounds = sync[0].rounds if sync else None
    for arm, h in keys:
        runs = sorted((r for r in results if (r.arm, r.h) == (arm, h)), key=lambda r: r.seed)
        rounds = runs[0].rounds
        rows.append({
            "arm": arm,
            "h": h,
            "seeds": [r.seed for r in runs],
            "nodes_bpb": stats([r.curve[-1].nodes_bpb for r in runs]),
            "held_out_bpb": stats([r.curve[-1].held_out_bpb for r in runs]),
            "rounds": rounds,
            "steps_per_node": sorted({s for r in runs for s in r.steps_per_node}),
            "communication_ratio": (sync_rounds / rounds) if sync_rounds and rounds else None,
            "seconds": statistics.fmean(r.seconds for r in runs),
        })  # fmt: skip
    return rows


def paired_gap(results: Sequence[Result], arm: str, h: int | None, field: str) -> list[float]:
    """Per seed, the arm's final value minus the sync arm's (same seed, same start)."""
    sync = {r.seed: getattr(r.curve[-1], field) for r in results if r.arm == "sync"}
    return [getattr(r.curve[-1], field) - sync[r.seed]
            for r in results if (r.arm, r.h) == (arm, h) and r.seed in sync]  # fmt: skip


def verdict(gaps: Sequence[float]) -> str:
    """Against sync, over the seeds' paired gaps: beats (every seed lower), loses (every
    seed higher), matches (the seeds disagree)."""
    if all(g < 0 for g in gaps):
        return "beats"
    if all(g > 0 for g in gaps):
        return "loses to"
    return "matches"


def fmt(s: dict[str, float]) -> str:
    return f"{s['mean']:.3f} ± {s['std']:.3f}"


def report(rows: Sequence[dict[str, Any]], results: Sequence[Result], held_out: str) -> list[str]:
    lines = [
        f"{'arm':<46} {'H':>3} {'rounds':>6} {'sync/arm':>8} {'steps/node':>10} "
        f"{'own held-out files':>18} {repr(held_out) + ' (held-out pkg)':>20} "
        f"{'gap to sync (files / pkg)':>26}"
    ]
    for row in rows:
        ratio = row["communication_ratio"]
        gap_files = paired_gap(results, row["arm"], row["h"], "nodes_bpb")
        gap_pkg = paired_gap(results, row["arm"], row["h"], "held_out_bpb")
        gap = ""
        if row["arm"] != "sync" and gap_files:
            gap = f"{statistics.fmean(gap_files):+.3f} / {statistics.fmean(gap_pkg):+.3f}"
        lines.append(
            f"{LABELS[row['arm']]:<46} {row['h'] if row['h'] else '-':>3} {row['rounds']:>6} "
            f"{('-' if ratio is None else f'{ratio:g}x'):>8} "
            f"{','.join(map(str, row['steps_per_node'])):>10} {fmt(row['nodes_bpb']):>18} "
            f"{fmt(row['held_out_bpb']):>20} {gap:>26}"
        )
    verdicts = []
    for row in rows:
        if row["arm"] in ("sync",):
            continue
        files = paired_gap(results, row["arm"], row["h"], "nodes_bpb")
        pkg = paired_gap(results, row["arm"], row["h"], "held_out_bpb")
        if not files:
            continue
        h = f" H={row['h']}" if row["h"] else ""
        verdicts.append(
            f"{row['arm']}{h} {verdict(files)} sync on the nodes' files "
            f"(gaps {', '.join(f'{g:+.3f}' for g in files)}), {verdict(pkg)} sync on "
            f"{held_out!r} (gaps {', '.join(f'{g:+.3f}' for g in pkg)})"
        )
    return [*lines, "", *verdicts]


def plot(path: Path, results: Sequence[Result], setup: Setup, held_out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"diloco": "tab:blue", "fedavg": "tab:orange", "sync": "black", "local": "tab:grey"}
    hs = sorted({r.h for r in results if r.h is not None})
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharey="row")
    for arm, h in dict.fromkeys((r.arm, r.h) for r in results):
        runs = [r for r in results if (r.arm, r.h) == (arm, h)]
        steps = np.array([p.step for p in runs[0].curve])
        rounds = np.array([p.rounds for p in runs[0].curve])
        label = LABELS[arm] + (f", H = {h}" if h else "")
        style = styles[hs.index(h) % len(styles)] if h else "-"
        for row, field in enumerate(("nodes_bpb", "held_out_bpb")):
            values = np.array([[getattr(p, field) for p in r.curve] for r in runs])
            mean = values.mean(axis=0)
            for col, x in enumerate((rounds, steps)):
                ax = axes[row, col]
                if col == 0 and arm == "local":
                    ax.axhline(mean[-1], color=colours[arm], linestyle=":", linewidth=1,
                               label=f"{label} (never communicates): final")  # fmt: skip
                    continue
                keep = x > 0 if col == 0 else np.ones_like(x, dtype=bool)
                ax.plot(x[keep], mean[keep], style, color=colours[arm], label=label, linewidth=1.3)
                ax.fill_between(x[keep], values.min(axis=0)[keep], values.max(axis=0)[keep],
                                color=colours[arm], alpha=0.12)  # fmt: skip
    for row, what in enumerate(("the nodes' own held-out files (mean over nodes)",
                                f"the held-out package {held_out!r}")):  # fmt: skip
        axes[row, 0].set_xscale("log")
        axes[row, 0].set_xlabel("communication rounds (log)")
        axes[row, 1].set_xlabel("inner steps per node")
        axes[row, 0].set_ylabel(f"bits per byte on\n{what}")
        for ax in axes[row]:
            ax.grid(alpha=0.3)
    low = min(min(p.nodes_bpb, p.held_out_bpb) for r in results for p in r.curve)
    for ax in axes.flat:
        ax.set_ylim(low - 0.1, low + 2.0)
    axes[0, 1].legend(fontsize=7, loc="upper right")
    seeds = sorted({r.seed for r in results})
    fig.suptitle(
        f"byte LM on the standard library: {setup.nodes} nodes, {setup.steps} AdamW steps of "
        f"{setup.batch} windows per node, d-model {setup.shape.d_model}; mean over seeds "
        f"{seeds}, band = min..max",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv: list[str] | None) -> argparse.Namespace:
    default = Setup()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=default.nodes)
    parser.add_argument("--steps", type=int, default=default.steps, help="inner steps per node")
    parser.add_argument("--batch", type=int, default=default.batch)
    parser.add_argument("--hs", type=int, nargs="+", default=[10, 50], help="values of H")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=default.shape.d_model)
    parser.add_argument("--layers", type=int, default=default.shape.layers)
    parser.add_argument("--eval-every", type=int, default=default.eval_every)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    quick = "2 seeds, 2 nodes, 40 steps, H in {5, 20}, a smaller model"
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: results/)")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.nodes, args.steps, args.hs = 2, 2, 40, [5, 20]
        args.d_model, args.eval_every = 32, 5
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    shape = ModelShape(d_model=args.d_model, layers=args.layers, heads=4, seq_len=64)
    setup = Setup(nodes=args.nodes, steps=args.steps, batch=args.batch, shape=shape,
                  eval_every=args.eval_every)  # fmt: skip
    data = Data.of(setup)
    params = sum(p.numel() for p in ByteLM(shape).parameters())
    load_before = os.getloadavg()
    packages = ", ".join("+".join(c.packages) for c in data.corpora)
    device = trainers_of(setup, data, 0)[0].device
    print(
        f"== byte LM: {setup.nodes} nodes ({packages}), held-out package "
        f"{data.held_out_name!r}; {setup.steps} inner steps per node of {setup.batch} "
        f"windows; model {params:,} parameters; H in {args.hs}; seeds 0..{args.seeds - 1}; "
        f"torch {torch.__version__} on {device}; load {load_before[0]:.1f}",
        flush=True,
    )
    plan = [(arm, h) for arm in args.arms for h in (args.hs if arm in OUTER else [None])]
    out = args.out or RESULTS / ("lm-quick.json" if args.quick else "lm.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {
        "setup": {**dataclasses.asdict(setup), "hs": args.hs, "seeds": args.seeds,
                  "parameters": params, "held_out": data.held_out_name,
                  "packages": [list(c.packages) for c in data.corpora]},
        "complete": False,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }  # fmt: skip
    results: list[Result] = []
    loads = [load_before[0]]
    started = time.perf_counter()
    for seed in range(args.seeds):
        for arm, h in plan:
            result = run_arm(setup, data, arm, h, seed)
            results.append(result)
            loads.append(os.getloadavg()[0])
            last = result.curve[-1]
            print(
                f"  seed {seed} {arm:<6} H={h or '-':<3} rounds {result.rounds:>4}  files "
                f"{last.nodes_bpb:.3f}  {data.held_out_name!r} {last.held_out_bpb:.3f}  "
                f"({result.seconds:.0f} s, load {loads[-1]:.1f})",
                flush=True,
            )
            # written after every run: an interrupted run keeps the seeds it finished
            payload |= {"runs": [dataclasses.asdict(r) for r in results],
                        "seconds": time.perf_counter() - started,
                        "load": {"start": load_before, "after_each_run": loads[1:]}}  # fmt: skip
            out.write_text(json.dumps(payload, indent=1) + "\n")
    rows = summarise(results)
    lines = report(rows, results, data.held_out_name)
    minutes = payload["seconds"] / 60
    print(
        f"\nfinal bits per byte, mean ± std over {args.seeds} seeds ({minutes:.1f} min, "
        f"load {min(loads):.1f} to {max(loads):.1f}):"
    )
    print("\n".join(lines))
    payload |= {"complete": True, "rows": rows, "report": lines}
    out.write_text(json.dumps(payload, indent=1) + "\n")
    plot(out.with_suffix(".png"), results, setup, data.held_out_name)
    print(f"wrote {out.name} and {out.with_suffix('.png').name} under {out.parent.name}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
