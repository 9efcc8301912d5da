"""Benchmark: what int8 releases and masked rounds cost on the byte language model (apps/lm).

Run ``python benchmarks/bench_lm_costs.py`` (``--help`` for the settings; ``--quick`` for a
smoke run of about a minute). It reads the LM app's run config from
``apps/lm/pyproject.toml`` (the model at its default size, 1,727,488 parameters; the
data split, the inner AdamW), and runs the same federation (seed, nodes, rounds, H) four
times, once per arm:

* ``plaintext``: float32 releases (the app's default);
* ``int8``: ``lensemble.quantize = "int8"``;
* ``masked``: ``lensemble.secagg-threshold = t`` (secure aggregation; t is a majority of
  the nodes unless ``--threshold`` says otherwise);
* ``int8+masked``: both (the package masks the int8-rounded values as int64 fixed point).

Every arm is the app's own code: its ServerApp side is a ``LensembleStrategy`` built by
``flower_app.strategy_from_context`` (durable writes, as on a deployment), its nodes the
app's ClientApp (``lm.client_app``), answering through an in-process Grid
(``bench_learning.LoopbackGrid``: each instruction is handed to the node's ClientApp as
it is pushed, so a round costs its training and the strategy, no engine's ticks). The
nodes train the global model only (``local-only = false``: the local-only twin is not
what is measured here) and nobody evaluates during the run (``fraction-evaluate = 0``).
After the last round the benchmark measures the final global model in bits per byte on
the package no node trained on and on each node's held-out files.

Timing. The grid notes when each round's first instruction goes out and how long every
ClientApp call takes; a wrapper around ``LmTraining.fit`` notes each node's inner loop.
A round runs from its first instruction to the next round's (the last: to the end of
``start``) and splits into

* **training**: the nodes' inner loops (``LmTraining.fit``);
* **participant, other**: the rest of the ClientApp calls (rebuilding or restoring the
  participant, the release chain: quantizing, masking, binding; saving its state; the
  records);
* **coordinator**: the rest of the round, all of it in the ServerApp's process (building
  and reading the messages, admission, aggregation, reveal, outer step, checkpoint,
  ledger and manifest, all fsynced).

The nodes answer one after another here; on a deployment they train side by side, so
the figure that says whether the coordinator slows a federation is its time against one
node's training time in the same round (``coord / node training``). The package's own
round metrics give the bytes (``lensemble.bytes-received`` and ``-sent``: content bytes of
the round's replies and instructions, every node together) and the exchanges per round.

Targets, per seed: every arm closes every round with every node and its ledger
verifies; every arm learns (the held-out package's bits per byte fall below the initial
model's); masked rounds give the plaintext model up to fixed-point rounding (within
0.01 bits per byte on both measures); and the coordinator's time per round is at most
10% of one node's training time in every arm. Writes ``benchmarks/results/lm_costs.json``
(``--out``). A report, not a test: the exit code is 0 whatever the verdict.

The code trains on CUDA when torch sees a GPU and on the CPU otherwise, as the app does
(``lm_model.lm_device``); the device is printed and written with the results.
"""

# ruff: noqa: E402  (Flower reads its environment when it is imported)
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from own_flwr_home import use_own_flwr_home

use_own_flwr_home("bench-lm-costs-flwr-")

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from bench_learning import LoopbackGrid, as_server_app
from bench_main_job import main_job_settings
from flwr.app import Context, Message, RecordDict

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.clients.threads import use_torch_threads
from lensemble_flwr.params import load_broadcast
from lensemble_flwr.provenance.ledger import RunManifest
from lensemble_flwr.provenance.verify import closed_attempt, verify
from lensemble_flwr.simulations import flower_app, lm
from lensemble_flwr.simulations.lm_data import node_corpus
from lensemble_flwr.simulations.lm_model import ByteLM, evaluate_bits_per_byte, lm_device
from lensemble_flwr.simulations.lm_training import ALL_SHARED, LmTrainer, LmTraining
from lensemble_flwr.strategies.records import PREFIX, arrays_to_record, record_to_arrays

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
ARMS = ("plaintext", "int8", "masked", "int8+masked")
MASKED_TOLERANCE = 0.01  # bits per byte: masked sums are exact up to fixed-point rounding
COORDINATOR_SHARE = 0.10  # of one node's training time per round


def arm_keys(arm: str, threshold: int) -> dict[str, Any]:
    """The run config keys that make ``arm`` (see the module)."""
    keys: dict[str, Any] = {}
    if "int8" in arm:
        keys["lensemble.quantize"] = "int8"
    if "masked" in arm:
        keys["lensemble.secagg-threshold"] = threshold
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}: one of {ARMS}")
    return keys


def lm_run_config(
    app: Mapping[str, Any],
    *,
    nodes: int,
    rounds: int,
    inner_steps: int,
    seed: int,
    eval_bytes: int,
) -> dict[str, Any]:
    """The app's run config for the benchmark's federation (the plaintext arm's): every
    node joins every round, seeded by ``seed`` (``init-seed`` and ``root-seed``; the data
    split stays the app's), no local-only model, no evaluation during the run, fixed
    deadlines far above a round's time, and the outer step its figures were measured with
    (DiLoCo's: lr 0.7, Nesterov momentum 0.9; the app's own default is plain averaging)."""
    return {
        **app,
        "num-server-rounds": rounds,
        "num-partitions": nodes,
        "fraction-evaluate": 0.0,
        "local-only": False,
        "eval-bytes": eval_bytes,
        "init-seed": seed,
        "lensemble.root-seed": seed,
        "lensemble.inner-steps": inner_steps,
        "lensemble.min-participants": nodes,
        "lensemble.deadline-mode": "fixed",
        "lensemble.open-timeout": 3600.0,
        "lensemble.collect-timeout": 3600.0,
        "lensemble.outer-lr": 0.7,
        "lensemble.outer-momentum": 0.9,
    }


# -- what the run does, noted as it happens -------------------------------------------
@dataclasses.dataclass
class Call:
    """One ClientApp call (``start``, ``end``: perf_counter seconds)."""

    node: int
    group: str  # the instruction's group id: its round
    kind: str  # its message type
    start: float
    end: float
    cpu: float = 0.0  # process CPU seconds of the call


@dataclasses.dataclass
class Log:
    """What :class:`TimedGrid` and :func:`timed_fit` note during one run."""

    round_starts: dict[int, float] = dataclasses.field(default_factory=dict)
    round_cpu: dict[int, float] = dataclasses.field(default_factory=dict)  # process_time
    calls: list[Call] = dataclasses.field(default_factory=list)
    fits: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    fit_cpu: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # (start, s)
    bench: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    updates: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def update_fields(content: RecordDict) -> dict[str, Any] | None:
    """What a train reply's update says of its encoding, read from its records without
    decoding the delta: its transforms, ``masked``, and its arrays' dtypes."""
    config = content.config_records.get(PREFIX + "update")
    if config is None:
        return None
    delta = content.array_records.get(PREFIX + "update.delta")
    dtypes = sorted({str(a.dtype) for a in delta.values()}) if delta is not None else []
    return {
        "sender": config.get("sender"),
        "round": config.get("round"),
        "transforms": list(config.get("transforms") or []),
        "masked": bool(config.get("masked", False)),
        "dtypes": dtypes,
    }


class TimedGrid(LoopbackGrid):
    """A LoopbackGrid that notes each round's first instruction and times every
    ClientApp call; it also notes each update's encoding (its own time is noted too,
    and left out of every share)."""

    def __init__(self, apps: dict[int, tuple[Any, Context]], log: Log) -> None:
        super().__init__(apps)
        self.log = log

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for message in messages:
            group = message.metadata.group_id
            if group.isdigit() and int(group) not in self.log.round_starts:
                self.log.round_starts[int(group)] = time.perf_counter()
                self.log.round_cpu[int(group)] = time.process_time()
            t0, c0 = time.perf_counter(), time.process_time()
            (message_id,) = super().push_messages([message])
            t1, cpu = time.perf_counter(), time.process_time() - c0
            node = message.metadata.dst_node_id
            kind = message.metadata.message_type
            self.log.calls.append(Call(node, group, kind, t0, t1, cpu))
            reply = self._replies.get(message_id)
            if reply is not None and reply.has_content():
                fields = update_fields(reply.content)
                if fields is not None:
                    self.log.updates.append(fields)
            self.log.bench.append((t1, time.perf_counter()))
            ids.append(message_id)
        return ids


@contextlib.contextmanager
def timed_fit(log: Log) -> Iterator[None]:
    """``LmTraining.fit`` timed into ``log.fits`` while the block runs (put back after)."""
    original = LmTraining.fit

    def fit(self: LmTraining, *args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            log.fits.append((t0, time.perf_counter()))
            log.fit_cpu.append((t0, time.process_time() - c0))

    LmTraining.fit = fit  # type: ignore[method-assign]
    try:
        yield
    finally:
        LmTraining.fit = original  # type: ignore[method-assign]


def _within(spans: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of ``spans`` that started in [start, end)."""
    return sum(b - a for a, b in spans if start <= a < end)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def round_split(log: Log, end: float, end_cpu: float, nodes: int) -> list[dict[str, float]]:
    """Each round's wall seconds and their split (see the module): training, participant
    other, coordinator, with ``coord / node training`` (the coordinator against the
    mean node's training time in the round). The three parts add up to the wall. Also
    the coordinator's CPU seconds (the process's CPU in the round less the ClientApp
    calls'): what is left of its wall time is waiting, mostly on fsync.

    Raises:
        ValueError: no round started, the rounds are not 1..R, or ``end`` is before
            the last round's start.
    """
    rounds = sorted(r for r in log.round_starts if r >= 1)
    if not rounds or rounds != list(range(1, len(rounds) + 1)):
        raise ValueError(f"rounds started: {rounds}; expected 1..R")
    bounds = [log.round_starts[r] for r in rounds] + [end]
    cpu_bounds = [log.round_cpu[r] for r in rounds] + [end_cpu]
    if end < bounds[-2]:
        raise ValueError("the run ended before its last round started")
    split = []
    for i, r in enumerate(rounds):
        start, stop = bounds[i], bounds[i + 1]
        wall = stop - start - _within(log.bench, start, stop)
        clientapp = _within(((c.start, c.end) for c in log.calls), start, stop)
        clientapp_cpu = sum(c.cpu for c in log.calls if start <= c.start < stop)
        training = _within(log.fits, start, stop)
        training_cpu = sum(c for t, c in log.fit_cpu if start <= t < stop)
        coordinator = wall - clientapp
        coordinator_cpu = cpu_bounds[i + 1] - cpu_bounds[i] - clientapp_cpu
        split.append(
            {
                "round": float(r),
                "wall": wall,
                "training": training,
                "participant_other": clientapp - training,
                "coordinator": coordinator,
                "coordinator_cpu": coordinator_cpu,
                "training_cpu": training_cpu,
                "coordinator_share": coordinator / wall,
                "coord_per_node_training": _ratio(coordinator, training / nodes),
                "coord_cpu_per_node_training_cpu": _ratio(coordinator_cpu, training_cpu / nodes),
            }
        )
    return split


# -- one arm ------------------------------------------------------------------------------
def node_contexts(run_config: Mapping[str, Any], nodes: int, run_id: int) -> dict[int, Context]:
    """Each node's Context, as a SuperNode of the simulation has it."""
    return {
        1000 * run_id + i: Context(
            run_id=run_id,
            node_id=1000 * run_id + i,
            node_config={"partition-id": i, "num-partitions": nodes},
            state=RecordDict(),
            run_config=dict(run_config),
        )
        for i in range(nodes)
    }


def final_bits_per_byte(
    params: Mapping[str, np.ndarray], run_config: Mapping[str, Any], nodes: int
) -> dict[str, Any]:
    """The model ``params`` in bits per byte: on the held-out package, on each node's
    held-out files, and their mean over the nodes (each node counts once)."""
    shape = lm.model_shape(run_config)
    model = ByteLM(shape).to(lm_device())
    load_broadcast(model, params, ALL_SHARED)
    held_out = evaluate_bits_per_byte(model, lm.held_out_windows(run_config))
    settings = lm.corpus_settings(run_config, nodes)
    eval_bytes = int(run_config.get("eval-bytes", lm.DEFAULT_EVAL_BYTES))
    per_node = []
    for i in range(nodes):
        trainer = LmTrainer(node_corpus(i, settings), shape, eval_bytes=eval_bytes)
        per_node.append(evaluate_bits_per_byte(model, trainer.validation))
    return {
        "held_out_package": held_out,
        "nodes": per_node,
        "nodes_mean": float(np.mean(per_node)),
    }


def _round_metrics(result: Any, rounds: int) -> list[dict[str, float]]:
    """The package's bookkeeping of each round (``lensemble.*`` of the train metrics)."""
    out = []
    for r in range(1, rounds + 1):
        metrics = result.train_metrics_clientapp.get(r) or {}
        out.append(
            {
                k[len("lensemble.") :]: float(v)
                for k, v in metrics.items()
                if k.startswith("lensemble.")
            }
        )
    return out


def run_arm(
    base: Mapping[str, Any], arm: str, *, nodes: int, threshold: int, run_id: int, run_dir: Path
) -> dict[str, Any]:
    """One arm: the federation of ``base`` with the arm's keys; its final bits per byte,
    its rounds' timing split, the package's round metrics, its updates' encodings, and
    what the ledger verified."""
    run_config = {**base, **arm_keys(arm, threshold), "run-dir": str(run_dir)}
    rounds = int(run_config["num-server-rounds"])
    server = Context(
        run_id=run_id, node_id=0, node_config={}, state=RecordDict(), run_config=run_config
    )
    config = flower_app.checked_config(server, lambda _: lm.check_app_keys(run_config))
    _, strategy = flower_app.strategy_from_context(
        server, config, poll_interval=0.001, durable_writes=True
    )
    log = Log()
    grid = TimedGrid(
        {n: (lm.client_app, c) for n, c in node_contexts(run_config, nodes, run_id).items()}, log
    )
    grid.set_run(run_id)
    initial = lm.initial_params(lm.model_shape(run_config), int(run_config["init-seed"]))
    cpu0, t0 = time.process_time(), time.perf_counter()
    with timed_fit(log):
        result = strategy.start(
            grid=grid, initial_arrays=arrays_to_record(initial), num_rounds=rounds
        )
    end, end_cpu = time.perf_counter(), time.process_time()
    split = round_split(log, end, end_cpu, nodes)
    params = record_to_arrays(result.arrays)
    store = Store(Path(result.run_dir))
    ledger = verify(store)
    return {
        "arm": arm,
        "keys": arm_keys(arm, threshold),
        "final": final_bits_per_byte(params, run_config, nodes),
        "rounds": split,
        "round_metrics": _round_metrics(result, rounds),
        "setup_seconds": log.round_starts[1] - t0 if 1 in log.round_starts else None,
        "run_seconds": end - t0,
        "run_cpu_seconds": end_cpu - cpu0,
        "updates": log.updates,
        "message_kinds": sorted({c.kind for c in log.calls}),
        "ledger_counts": [r.count for r in ledger],
        "secure_sum": secure_sums(store),
        "fits": len(log.fits),
    }


def secure_sums(store: Store) -> list[bool]:
    """Whether each closed round's outer step took a revealed masked sum (the manifest)."""
    by_round: dict[int, list[Any]] = {}
    for entry in RunManifest.load(store).rounds:
        by_round.setdefault(entry.round, []).append(entry)
    closed = (closed_attempt(by_round[r]) for r in sorted(by_round))
    return [bool(c is not None and c.secure_sum) for c in closed]


# -- the benchmark ------------------------------------------------------------------------
def summarize(arm: Mapping[str, Any], nodes: int) -> dict[str, float]:
    """An arm's figures, each a mean over its rounds (bytes: per participant per round)."""
    rounds, metrics = arm["rounds"], arm["round_metrics"]

    def mean(values: Iterable[float]) -> float:
        return float(statistics.fmean(values))

    def per_node(key: str) -> float:
        return mean(m.get(key, float("nan")) / max(m.get("C_t", nodes), 1) for m in metrics)

    wall = mean(r["wall"] for r in rounds)
    coordinator = mean(r["coordinator"] for r in rounds)
    training = mean(r["training"] for r in rounds)
    return {
        "held_out_package_bpb": arm["final"]["held_out_package"],
        "nodes_bpb": arm["final"]["nodes_mean"],
        "seconds_per_round": wall,
        "training_per_round": training,
        "node_training_per_round": training / nodes,
        "participant_other_per_round": mean(r["participant_other"] for r in rounds),
        "coordinator_per_round": coordinator,
        "coordinator_cpu_per_round": mean(r["coordinator_cpu"] for r in rounds),
        "coordinator_share": coordinator / wall,
        "coord_per_node_training": coordinator / (training / nodes),
        "coord_cpu_per_node_training_cpu": mean(r["coordinator_cpu"] for r in rounds)
        / (mean(r["training_cpu"] for r in rounds) / nodes),
        "upload_bytes_per_participant": per_node("bytes-received"),
        "download_bytes_per_participant": per_node("bytes-sent"),
        "exchanges": mean(m.get("exchanges", float("nan")) for m in metrics),
        "package_seconds": mean(m.get("seconds", float("nan")) for m in metrics),
    }


def run_seed(
    app: Mapping[str, Any], seed: int, args: argparse.Namespace, order: list[str], tmp: Path
) -> dict[str, Any]:
    """Every arm of ``order`` on one seed, with the initial model's bits per byte."""
    base = lm_run_config(
        app,
        nodes=args.nodes,
        rounds=args.rounds,
        inner_steps=args.inner_steps,
        seed=seed,
        eval_bytes=args.eval_bytes,
    )
    initial = lm.initial_params(lm.model_shape(base), seed)
    out: dict[str, Any] = {"initial": final_bits_per_byte(initial, base, args.nodes), "arms": {}}
    for k, arm in enumerate(order):
        run_id = 10 * (seed + 1) + k
        started = time.perf_counter()
        result = run_arm(
            base, arm, nodes=args.nodes, threshold=args.threshold, run_id=run_id, run_dir=tmp
        )
        result["summary"] = summarize(result, args.nodes)
        result["load_after"] = os.getloadavg()
        out["arms"][arm] = result
        s = result["summary"]
        print(
            f"  seed {seed} {arm:<12} {time.perf_counter() - started:5.0f} s: held-out package "
            f"{s['held_out_package_bpb']:.4f} bpb, nodes {s['nodes_bpb']:.4f}, "
            f"{s['seconds_per_round']:.2f} s/round, coordinator {s['coordinator_per_round']:.3f} s",
            flush=True,
        )
    return out


def warm_up(app: Mapping[str, Any], arms: list[str], tmp: Path) -> None:
    """One round of every arm on 3 nodes with H = 1 first, untimed, so that no measured
    arm pays a first call's costs (torch's, and the compiled kernels' compilation)."""
    run = lm_run_config(app, nodes=3, rounds=1, inner_steps=1, seed=0, eval_bytes=64)
    for k, arm in enumerate(arms):
        run_arm(run, arm, nodes=3, threshold=2, run_id=1 + k, run_dir=tmp)


def table(per_seed: Mapping[str, Any], arms: list[str]) -> list[dict[str, Any]]:
    """Per arm: the mean over the seeds of its figures, and of its differences in bits
    per byte from the plaintext arm of the same seed."""
    rows = []
    for arm in arms:
        summaries = [s["arms"][arm]["summary"] for s in per_seed.values()]
        row: dict[str, Any] = {"arm": arm}
        for key in summaries[0]:
            row[key] = float(statistics.fmean(x[key] for x in summaries))
        if "plaintext" in arms:
            for key in ("held_out_package_bpb", "nodes_bpb"):
                diffs = [
                    s["arms"][arm]["summary"][key] - s["arms"]["plaintext"]["summary"][key]
                    for s in per_seed.values()
                ]
                row[f"{key}_diff"] = float(statistics.fmean(diffs))
                row[f"{key}_diff_max"] = float(max(diffs, key=abs))
        rows.append(row)
    return rows


def targets(per_seed: Mapping[str, Any], nodes: int, rounds: int) -> list[dict[str, Any]]:
    """The PASS/FAIL lines (see the module)."""
    out = []
    for seed, s in per_seed.items():
        initial = s["initial"]["held_out_package"]
        for arm, a in s["arms"].items():
            complete = a["ledger_counts"] == [nodes] * rounds
            out.append(
                {
                    "target": f"seed {seed} {arm}: every round closed with every node "
                    "and its ledger verified",
                    "value": str(a["ledger_counts"]),
                    "pass": complete,
                }
            )
            out.append(
                {
                    "target": f"seed {seed} {arm}: held-out package bpb below the "
                    f"initial model's {initial:.3f}",
                    "value": a["summary"]["held_out_package_bpb"],
                    "pass": a["summary"]["held_out_package_bpb"] < initial,
                }
            )
            share = a["summary"]["coord_per_node_training"]
            out.append(
                {
                    "target": f"seed {seed} {arm}: coordinator <= {COORDINATOR_SHARE:.0%} "
                    "of one node's training time per round",
                    "value": share,
                    "pass": share <= COORDINATOR_SHARE,
                }
            )
        if "masked" in s["arms"] and "plaintext" in s["arms"]:
            plain, masked = s["arms"]["plaintext"]["summary"], s["arms"]["masked"]["summary"]
            diff = max(abs(masked[k] - plain[k]) for k in ("held_out_package_bpb", "nodes_bpb"))
            out.append(
                {
                    "target": f"seed {seed}: masked within {MASKED_TOLERANCE} bpb of plaintext",
                    "value": diff,
                    "pass": diff <= MASKED_TOLERANCE,
                }
            )
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{'arm':<12} {'held-out pkg':>12} {'diff':>8} {'nodes':>7} {'diff':>8} "
        f"{'s/round':>8} {'training':>9} {'part.other':>10} {'coord':>7} {'coord/wall':>10} "
        f"{'coord/node tr.':>14} {'(cpu)':>6} {'up MB/node':>10} {'down MB/node':>12} {'exch':>5}"
    )
    for r in rows:
        print(
            f"{r['arm']:<12} {r['held_out_package_bpb']:12.4f} "
            f"{r.get('held_out_package_bpb_diff', float('nan')):+8.5f} {r['nodes_bpb']:7.4f} "
            f"{r.get('nodes_bpb_diff', float('nan')):+8.5f} {r['seconds_per_round']:8.2f} "
            f"{r['training_per_round']:9.2f} {r['participant_other_per_round']:10.3f} "
            f"{r['coordinator_per_round']:7.3f} {r['coordinator_cpu_per_round']:6.3f} "
            f"{r['coordinator_share']:10.1%} "
            f"{r['coord_per_node_training']:14.1%} {r['coord_cpu_per_node_training_cpu']:6.1%} "
            f"{r['upload_bytes_per_participant'] / 1e6:10.2f} "
            f"{r['download_bytes_per_participant'] / 1e6:12.2f} {r['exchanges']:5.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--inner-steps", type=int, default=None, help="H; default: the app's")
    parser.add_argument("--eval-bytes", type=int, default=16384)
    parser.add_argument("--threshold", type=int, default=None, help="default: nodes // 2 + 1")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--quick", action="store_true", help="3 nodes, 2 rounds, H = 5, 1 seed")
    parser.add_argument("--out", type=Path, default=RESULTS / "lm_costs.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.nodes, args.rounds, args.inner_steps = args.seeds[:1], 3, 2, 5
        args.eval_bytes = 4096
        if args.out == RESULTS / "lm_costs.json":
            args.out = RESULTS / "lm_costs-quick.json"
    app = main_job_settings(ROOT / "apps" / "lm" / "pyproject.toml")
    if args.inner_steps is None:
        args.inner_steps = int(app["lensemble.inner-steps"])
    if args.threshold is None:
        args.threshold = args.nodes // 2 + 1
    logging.getLogger("flwr").setLevel(logging.ERROR)
    logging.basicConfig(level=logging.ERROR)
    threads = use_torch_threads()  # as the app's ClientApps (clients/threads.py)
    as_server_app()
    device = lm_device()
    load = os.getloadavg()
    print(
        f"== the byte LM ({sum(a.size for a in lm.initial_params(lm.model_shape(app)).values()):,} "
        f"parameters) on {device}, {threads} torch thread(s): {args.nodes} nodes, "
        f"{args.rounds} rounds, H = {args.inner_steps}, threshold {args.threshold}, "
        f"seeds {args.seeds}; load {load[0]:.1f}",
        flush=True,
    )
    started = time.perf_counter()
    per_seed: dict[str, Any] = {}
    header = {
        "command": "python benchmarks/bench_lm_costs.py " + " ".join(argv or sys.argv[1:]),
        "settings": {
            "nodes": args.nodes,
            "rounds": args.rounds,
            "inner_steps": args.inner_steps,
            "threshold": args.threshold,
            "seeds": args.seeds,
            "eval_bytes": args.eval_bytes,
            "model": dataclasses.asdict(lm.model_shape(app)),
        },
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": str(device),
            "torch_threads": threads,
            "cpus": os.cpu_count(),
        },
    }
    with tempfile.TemporaryDirectory(prefix="bench-lm-costs-") as tmp:
        warm_up(app, args.arms, Path(tmp))
        for k, seed in enumerate(args.seeds):
            order = args.arms[k % len(args.arms) :] + args.arms[: k % len(args.arms)]
            per_seed[str(seed)] = run_seed(app, seed, args, order, Path(tmp))
            # after every seed, so that a run cut short keeps the seeds it finished
            results = {
                **header,
                "complete": k == len(args.seeds) - 1,
                "table": table(per_seed, args.arms),
                "per_seed": per_seed,
                "targets": targets(per_seed, args.nodes, args.rounds),
                "seconds": time.perf_counter() - started,
                "load": {"start": load, "end": os.getloadavg()},
            }
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")
    print_table(results["table"])
    print(
        f"\n{len(args.seeds)} seed(s) in {results['seconds']:.0f} s (load {load[0]:.1f} at the "
        f"start, {results['load']['end'][0]:.1f} at the end); wrote {args.out.name}"
    )
    checks = results["targets"]
    if args.quick:  # 5 inner steps a round: no node trains long enough for the targets
        print("quick run: a smoke test of the arms, not a measurement of the targets")
    for t in checks:
        value = f"{t['value']:.4f}" if isinstance(t["value"], float) else str(t["value"])
        verdict = "(quick run)" if args.quick else ("PASS" if t["pass"] else "FAIL")
        print(f"{verdict}: {t['target']} ({value})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
