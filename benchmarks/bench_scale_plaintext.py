"""Benchmark: plaintext rounds in process up to C = 10,000 participants, and the
coordinator's memory across rounds.

Run ``python benchmarks/bench_scale_plaintext.py`` (``--quick`` for small C, ``--help``).
A Coordinator and C participants run on an :class:`InProcessNetwork` (simulated clock);
every participant trains a no-op model of P = 10,100 parameters (``nn.Linear(100, 100)``
named ``encoder``, loss ``(p * 0).sum()``, H = 1 step, batch 1), so what grows with C is
the runtime: messages, validation, hashing, the release pipeline, the exact sum, commit.
Torch runs on one thread (the model is tiny; more threads only contend).

Targets (each ends with a PASS/FAIL line; the exit code is 0 either way):

1. Time per round linear in C: the least-squares slope of log(wall per round) against
   log(C) over C = 1000, 2000, 5000, 10000 is <= 1.1. Each C runs ``--rounds`` timed
   rounds at the largest C and proportionally more at smaller ones (the same time at
   each C), and the best round counts (the machine is shared: the least disturbed round
   is the closest to the cost itself); the slope of the mean round is printed too. Also
   printed: the coordinator's share of the wall time (everything outside the
   participants' ``handle``: the coordinator and the network that carries its messages)
   and the same slope for that share alone (informational).
2. Memory flat across rounds: at fixed C (``--memory-c``), the memory retained after
   rounds ``--early`` … ``--late`` (``tracemalloc``, after a garbage collection, sampled
   at 6 rounds; the network's bounded delivery log switched off, so what remains is the
   coordinator's and the participants' own): the least-squares slope of the retained
   bytes against the round, per participant, is <= 1 byte per participant-round (it was
   ~420 bytes: the in-memory manifest's update digests and the network's log, then ~8:
   every outcome's contributors). Also printed: the retained bytes after round 1.
   ``--early`` defaults past the outcomes the coordinator keeps (16), which fill first.
3. Memory in a round O(model) + O(1) per participant:
   a. the bytes the coordinator's object graph holds while a round aggregates (every
      participant's update admitted), at C = 250, 1000, 4000: the bytes per participant
      added from 250 to 1000 and from 250 to 4000 agree within 50% (O(1) per participant,
      not growing with C; hash tables grow in doublings, hence the slack); the fixed part
      is printed as a multiple of the model's size;
   b. the traced peak of a whole in-process round above the memory at its start
      (``tracemalloc``: coordinator, network and participants; every update is in flight
      at once on the simulated clock, so this is O(model) per participant by design): the
      bytes per participant added from the smallest C to each larger one agree within 50%.

``--out FILE`` writes every figure as JSON (``benchmarks/plot_scaling.py`` plots it).
The default run takes about 10 minutes on 2 cores; ``--quick`` runs C = 250 … 2000 and a
shorter memory pass.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import tempfile
import time
import tracemalloc
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.participant.participant import Participant
from lensemble_flwr.protocol.round import RoundMachine, RoundState
from lensemble_flwr.transports.inprocess import InProcessNetwork


class NoOpModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(100, 100)  # P = 10,100


class NoOpTrainer:
    """A Trainer whose batches are nothing and whose loss is a constant zero."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.model = NoOpModel()

    def num_examples(self) -> int:
        return 1

    def dataset_records(self) -> Iterator[bytes]:
        yield self.index.to_bytes(4, "little")

    def sample_batch(self, generator: torch.Generator, batch_size: int) -> Any:
        return None

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return sum((p * 0).sum() for p in model.parameters())  # type: ignore[return-value]


class TimedParticipant(Participant):
    """A Participant that adds the wall time of its ``handle`` to a shared counter."""

    spent: ClassVar[list[float]] = [0.0]

    def handle(self, payload: Any) -> None:
        t0 = time.perf_counter()
        try:
            super().handle(payload)
        finally:
            TimedParticipant.spent[0] += time.perf_counter() - t0


def build(
    config: LensembleConfig, run_dir: Path, participants: int, *, delivery_log: int | None
) -> tuple[Coordinator, InProcessNetwork]:
    network = InProcessNetwork(join_endpoint=str(run_dir), delivery_log=delivery_log)
    for i in range(participants):
        pid = f"p{i:05d}"
        node = TimedParticipant(
            config, participant_id=pid, transport=network.transport_for(pid), trainer=NoOpTrainer(i)
        )
        network.attach(node)
    initial = {n: t.detach().numpy().copy() for n, t in NoOpModel().state_dict().items()}
    coordinator = Coordinator(
        config, transport=network.coordinator, initial_params=initial, store=Store(run_dir)
    )
    return coordinator, network


def run_rounds(coordinator: Coordinator, rounds: int, participants: int) -> None:
    """Run ``rounds`` rounds, one at a time (the coordinator keeps its latest outcomes
    only); raises unless each closed, first time, with all participants."""
    for _ in range(rounds):
        start = len(coordinator.outcomes)
        coordinator.run(1)
        for o in coordinator.outcomes[start:]:
            if o.state is not RoundState.CLOSED or o.count != participants:
                raise RuntimeError(f"round {o.round} ended {o.state.value} with C_t={o.count}")


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) against log(x)."""
    lx, ly = np.log(xs), np.log(ys)
    return float(np.polyfit(lx, ly, 1)[0])


# -- target 1 ------------------------------------------------------------------------------
def time_per_round(config: LensembleConfig, c: int, rounds: int) -> list[tuple[float, float]]:
    """(wall seconds, the coordinator side's seconds) of each of ``rounds`` rounds, after
    one warm-up."""
    timed = []
    with tempfile.TemporaryDirectory(prefix="lensemble-bench-") as tmp:
        coordinator, network = build(config, Path(tmp), c, delivery_log=0)
        run_rounds(coordinator, 1, c)
        network.flush()
        gc.collect()
        for _ in range(rounds):
            TimedParticipant.spent[0] = 0.0
            t0 = time.perf_counter()
            run_rounds(coordinator, 1, c)
            wall = time.perf_counter() - t0
            timed.append((wall, wall - TimedParticipant.spent[0]))
        del coordinator, network
        gc.collect()
    return timed


# -- target 2 ------------------------------------------------------------------------------
_SKIP = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)


def graph_bytes(root: object, exclude: tuple[object, ...]) -> int:
    """Bytes of every object reachable from ``root`` (each counted once), not entering
    ``exclude``, classes, modules or functions."""
    seen = {id(x) for x in exclude}
    stack, total = [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _SKIP):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, np.ndarray):
            continue  # getsizeof counts the data it owns
        stack.extend(gc.get_referents(obj))
    return total


def during_round(config: LensembleConfig, c: int) -> int:
    """Bytes the coordinator's object graph holds once every update of round 2 is in."""
    with tempfile.TemporaryDirectory(prefix="lensemble-bench-") as tmp:
        coordinator, _ = build(config, Path(tmp), c, delivery_log=0)
        run_rounds(coordinator, 1, c)
        measured: list[int] = []

        def watch(machine: RoundMachine, coordinator: Coordinator = coordinator) -> None:
            if machine.state is RoundState.AGGREGATING and not measured:
                skip = (coordinator.transport, coordinator.on_transition)
                measured.append(graph_bytes(coordinator, skip))

        coordinator.on_transition = watch
        run_rounds(coordinator, 1, c)
    gc.collect()
    return measured[0]


def in_round_peak(config: LensembleConfig, c: int) -> int:
    """Traced peak bytes of round 2 above the traced bytes at its start."""
    with tempfile.TemporaryDirectory(prefix="lensemble-bench-") as tmp:
        coordinator, network = build(config, Path(tmp), c, delivery_log=0)
        run_rounds(coordinator, 1, c)
        network.flush()
        gc.collect()
        tracemalloc.start()
        start = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        run_rounds(coordinator, 1, c)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del coordinator, network
        gc.collect()
    return peak - start


def checkpoints(early: int, late: int, count: int = 6) -> list[int]:
    """``count`` rounds from ``early`` to ``late``, evenly spaced (distinct)."""
    return sorted({round(early + (late - early) * i / (count - 1)) for i in range(count)})


def retained(config: LensembleConfig, c: int, rounds: list[int]) -> dict[int, int]:
    """Traced bytes after each round of ``[1, *rounds]`` (after a collection); tracing
    starts once round 1 is done, so the figure after round 1 is the baseline (0)."""
    with tempfile.TemporaryDirectory(prefix="lensemble-bench-") as tmp:
        coordinator, network = build(config, Path(tmp), c, delivery_log=0)
        run_rounds(coordinator, 1, c)
        network.flush()
        gc.collect()
        tracemalloc.start()
        kept, done = {1: tracemalloc.get_traced_memory()[0]}, 1
        for r in rounds:
            run_rounds(coordinator, r - done, c)
            done = r
            network.flush()
            gc.collect()
            kept[r] = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del coordinator, network
        gc.collect()
    return kept


def linear_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of y against x."""
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="C = 250 … 2000, shorter passes")
    parser.add_argument("--sizes", type=int, nargs="*", default=None, help="C for target 1")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds at the largest C")
    parser.add_argument("--memory-c", type=int, default=None, help="C for target 2")
    parser.add_argument("--early", type=int, default=20, help="first round of target 2's fit")
    parser.add_argument("--late", type=int, default=200, help="last round of target 2's fit")
    parser.add_argument("--max-slope", type=float, default=1.1)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    sizes = args.sizes or ([250, 500, 1000, 2000] if args.quick else [1000, 2000, 5000, 10000])
    memory_c = args.memory_c or (50 if args.quick else 100)
    late = min(args.late, 60) if args.quick else args.late
    trio = (100, 400, 1600) if args.quick else (250, 1000, 4000)
    config = LensembleConfig(
        federation={"min_participants": 1, "open_timeout": 60, "collect_timeout": 60},
        inner={"steps": 1, "batch_size": 1},
        groups={"shared": ("encoder",), "local": ()},
    )
    model_bytes = sum(p.numel() * 4 for p in NoOpModel().parameters())
    print(
        f"== plaintext rounds in process: C = {sizes}, {args.rounds} timed rounds at the "
        f"largest C (more at smaller C, for the same time) after one warm-up; no-op trainer, "
        f"P = 10,100; {os.cpu_count()} cores, Python {sys.version.split()[0]}, torch "
        f"{torch.__version__} (1 thread); load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'C':>7}{'s/round':>10}{'ms/participant':>16}{'coordinator share':>19}{'mean':>10}"
        f"{'rounds':>8}   (best round; mean of the rounds)"
    )
    walls, coords, means = [], [], []
    for c in sizes:
        rounds = max(args.rounds, round(args.rounds * sizes[-1] / c))  # same time per C
        timed = time_per_round(config, c, rounds)
        wall, coord = min(timed)  # the least disturbed round (the machine is shared)
        walls.append(wall)
        coords.append(coord)
        means.append(sum(w for w, _ in timed) / rounds)
        print(
            f"{c:>7}{wall:>10.3f}{wall / c * 1e3:>16.3f}{coord / wall:>19.1%}"
            f"{means[-1]:>10.3f}{rounds:>8}",
            flush=True,
        )
    k_wall, k_coord, k_mean = slope(sizes, walls), slope(sizes, coords), slope(sizes, means)
    print(
        f"log-log slope of wall per round (best round): {k_wall:.3f}; of the coordinator side: "
        f"{k_coord:.3f}; of the mean round: {k_mean:.3f}"
    )

    print(f"\n== memory in a round (C = {trio})")
    held = [during_round(config, c) for c in trio]
    per = [(held[i] - held[0]) / (trio[i] - trio[0]) for i in (1, 2)]
    fixed = held[0] - per[0] * trio[0]
    peaks = [in_round_peak(config, c) for c in trio]
    for c, h, pk in zip(trio, held, peaks, strict=True):
        print(
            f"C = {c:>5}: coordinator's graph while aggregating {h / 1e6:8.2f} MB; traced peak "
            f"of the round {pk / 1e6:8.2f} MB = {pk / c / 1e3:.1f} kB per participant",
            flush=True,
        )
    print(
        f"coordinator: {per[0]:.0f} B per participant from C = {trio[0]} to {trio[1]}, "
        f"{per[1]:.0f} B from {trio[0]} to {trio[2]}; fixed part {fixed / 1e6:.2f} MB = "
        f"{fixed / model_bytes:.1f} x the model's {model_bytes / 1e3:.0f} kB"
    )
    spread = max(per) / min(per) - 1
    peak_per = [(peaks[i] - peaks[0]) / (trio[i] - trio[0]) for i in (1, 2)]
    peak_fixed = peaks[0] - peak_per[0] * trio[0]
    peak_spread = max(peak_per) / min(peak_per) - 1
    print(
        f"whole round: {peak_per[0] / 1e3:.1f} kB per participant from C = {trio[0]} to "
        f"{trio[1]}, {peak_per[1] / 1e3:.1f} kB from {trio[0]} to {trio[2]}; fixed part "
        f"{peak_fixed / 1e6:.2f} MB = {peak_fixed / model_bytes:.1f} x the model"
    )

    rounds = checkpoints(args.early, late)
    print(f"\n== retained memory across rounds (C = {memory_c}, after rounds 1 and {rounds})")
    kept = retained(config, memory_c, rounds)
    for r, b in kept.items():
        print(f"after round {r:>4}: {(b - kept[1]) / 1e3:+10.1f} kB traced since round 1")
    growth = linear_slope(rounds, [kept[r] for r in rounds]) / memory_c
    print(f"slope over rounds {rounds[0]} … {rounds[-1]}: {growth:.3f} B per participant-round")

    verdicts = {
        "time_linear": k_wall <= args.max_slope,
        "memory_flat_across_rounds": growth <= 1.0,
        "coordinator_memory_per_participant": spread <= 0.5,
        "round_peak_per_participant": peak_spread <= 0.5,
    }
    line = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731
    print(
        f"\n{line(verdicts['time_linear'])}: time per round linear in C: slope {k_wall:.3f} "
        f"over C = {sizes} (target <= {args.max_slope}); coordinator side {k_coord:.3f}, "
        f"{coords[-1] / walls[-1]:.0%} of the wall at C = {sizes[-1]}"
    )
    print(
        f"{line(verdicts['memory_flat_across_rounds'])}: retained memory flat across rounds: "
        f"{growth:.3f} B per participant-round over rounds {rounds[0]} … {rounds[-1]} at "
        f"C = {memory_c} (target <= 1)"
    )
    print(
        f"{line(verdicts['coordinator_memory_per_participant'])}: coordinator memory in a "
        f"round O(model) + O(1) per participant: {per[0]:.0f} and {per[1]:.0f} B per "
        f"participant over C = {trio} differ by {spread:.0%} (target <= 50%); fixed part "
        f"{fixed / model_bytes:.1f} x the model"
    )
    print(
        f"{line(verdicts['round_peak_per_participant'])}: a round's traced peak O(model) + "
        f"O(1) per participant: {peak_per[0] / 1e3:.1f} and {peak_per[1] / 1e3:.1f} kB per "
        f"participant over C = {trio} differ by {peak_spread:.0%} (target <= 50%); fixed "
        f"part {peak_fixed / model_bytes:.1f} x the model"
    )
    if args.out is not None:
        figures = {
            "benchmark": "bench_scale_plaintext",
            "params": model_bytes // 4,
            "cores": os.cpu_count(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "timed_rounds_at_largest_c": args.rounds,
            "sizes": sizes,
            "wall_seconds_per_round": walls,
            "mean_wall_seconds_per_round": means,
            "mean_wall_exponent": k_mean,
            "coordinator_seconds_per_round": coords,
            "wall_exponent": k_wall,
            "coordinator_exponent": k_coord,
            "max_exponent": args.max_slope,
            "memory_sizes": list(trio),
            "coordinator_bytes_aggregating": held,
            "coordinator_bytes_per_participant": per,
            "coordinator_fixed_model_copies": fixed / model_bytes,
            "round_peak_bytes": peaks,
            "round_peak_bytes_per_participant": peak_per,
            "round_peak_fixed_model_copies": peak_fixed / model_bytes,
            "retained_c": memory_c,
            "retained_bytes_after_round": {str(r): b for r, b in kept.items()},
            "retained_bytes_per_participant_round": growth,
            "pass": verdicts,
        }
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
