"""Benchmark: seconds per round on Flower's simulation engine, LensembleStrategy vs FedAvg.

Run ``python benchmarks/bench_flower_round.py`` (``--help`` for sizes). For every N of
``--nodes`` (default 10, 50, 200 and 500; one child process each, so every N gets a fresh
Ray) one ``flwr.simulation.run_simulation`` (Ray backend) with N supernodes and a trivial
model (one float32 array ``w`` of 100 values). Its ServerApp runs, one after the other in
the same federation, blocks of rounds of up to four variants:

* ``FedAvg``: Flower's stock ``flwr.serverapp.strategy.FedAvg`` (``fraction_evaluate=0``,
  ``min_available_nodes = min_train_nodes = N``) driving a stock Message-API train
  function (``arrays + 1``, replying ``arrays`` and ``metrics{"num-examples"}``; with
  ``--stock-train torch``, one that trains as the lensemble participant does: a fresh
  model loads the arrays, one AdamW step, its state dict back, quickstart-pytorch's
  shape);
* ``LensembleStrategy`` (``fraction_evaluate=0``, ``min-participants = N``, collect
  timeout 120 s) driving ``make_client_app`` participants whose Trainer is a tiny
  ``nn.Module`` with one parameter ``w`` (groups ``shared="*"``, ``local=""``), loss
  ``-w.sum()``, H = 1 AdamW step: the plaintext path, one exchange per round;

each with the Grid polled every 0.10 s (Flower's ``InMemoryGrid.pull_interval`` default)
and, at N <= 50, also every 0.05 s (``LensembleStrategy``'s ``poll_interval`` default).
Rounds and blocks shrink with N (:data:`SCHEDULE`: 4 blocks x 41 rounds at N = 10, 2 x 3
at N = 500, where a round takes seconds) unless ``--rounds``/``--blocks``/``--polls`` say.
The two train functions live in one ClientApp that routes on the instruction (a
lensemble RoundOpen carries ``lensemble.kind`` in its config), so both strategies pay
the same per-message Ray cost (the app is pickled into every task) and share one Ray
start-up.

How a round is timed (the same for both): the ServerApp hands each strategy a thin Grid
proxy that records ``time.perf_counter()`` (and the ServerApp thread's CPU time) whenever
a round's train instructions are pushed: ``FedAvg.start`` pushes them through
``grid.send_and_receive``, ``LensembleStrategy`` through ``grid.push_messages``. A round
lasts from its push to the next round's push (the last round: to ``start`` returning),
so it includes building the instructions, the wait for the replies, aggregation and
whatever the strategy does between rounds (checkpoints, ledger, manifest). Ray start-up
and actor warm-up are excluded: before any block the ServerApp waits for every node to
answer a query and runs one untimed block of each strategy; in every block the first
round (``--discard``) is not measured either (for LensembleStrategy it is the round in
which participants bind their dataset commitments). Blocks rotate the variants' order.

Each reply also carries the seconds its train function took inside the Ray actor, with
its start and end time (one extra ConfigRecord, ``bench.client``, ignored by both
strategies), and the coordinator's Store writes are timed (a wrapper on
``Store._publish``), so a round splits into: dispatch (push -> first train call starts),
clients (-> last call ends), pickup (-> last reply in the ServerApp) and server (-> next
push), the last with the share spent in fsynced Store writes.

Flower 1.42's simulation engine looks for new instructions every 0.1 s (a hard-coded
wait in ``vce_api.add_messages_to_queue``), so a round lasts one or two such ticks and
the median jumps between ~0.1 and ~0.2 s from run to run; the verdict therefore uses the
mean over all measured rounds (median and min are printed too).

Phase. Whether a round fits in one tick depends on when its push lands between two
ticks, and that moment moves with the server phase's length each round: consecutive
rounds share their fate (runs of one-tick rounds, runs of two-tick ones), and the
rounds lock to the tick in ways that depend on the strategy's own timing. A block of a
few rounds sees only part of that, and its mean depends on the phase it starts at. So
every timed block starts after a random pause of 0 to 0.1 s (``--phase block``, the
default; ``--phase-seed``), and at N = 10 a block is 40 measured rounds long, so that
the rounds inside it keep their natural dynamics for long enough. ``--phase fixed``
never pauses. ``--phase round`` pauses a random part of a tick before every round's
push (not counted) and so draws every round's phase uniformly: a diagnostic only, since
a run's phase is not uniform (the locking is part of what a run costs; in a simulation
of the two loops, and on the engine, it gave a ratio some 0.05-0.15 lower at 0.05 s
polls than natural runs do). The ratio is printed with its standard error over the
blocks' means (paired by block). Block counts are multiples of four, so that the
rotation puts every variant in every position equally often.

With the defaults (2 Ray actors: ``num_cpus=1`` per ClientApp on 2 cores) N = 10 takes
~1-2 minutes and the four N together ~15-25 minutes.

Targets (issue 13), printed as one PASS/FAIL line each per N after a summary table:

* LensembleStrategy's seconds per round <= 1.1 x FedAvg's (plaintext path): the worst
  equal-poll ratio of means. The ratio with both strategies at their default polls ("as
  shipped") is printed for information only.
* The ClientApp's seconds per train message <= 2 x FedAvg's: the train calls' seconds
  inside the actors over every measured round of a strategy, divided by their number.

Diagnostics, not part of the targets: ``--profile`` (cProfile of the ServerApp
thread), ``--durable-writes`` (the coordinator's Store fsyncs as on a deployment;
by default it does not on the simulation engine), ``--extractor-tick``
(patches the engine's 0.1 s tick). It is a report, not a test: the exit code is 0
whatever the outcome.
"""

# ruff: noqa: E402  (flwr reads FLWR_TELEMETRY_ENABLED when it is imported)
from __future__ import annotations

import os
import tempfile

from own_flwr_home import use_own_flwr_home

use_own_flwr_home("bench-flwr-home-")

import argparse
import cProfile
import dataclasses
import functools
import json
import logging
import pstats
import random
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation
from torch import nn

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.clients.app import make_client_app
from lensemble_flwr.clients.live import process_participants
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.strategies import LensembleStrategy
from lensemble_flwr.strategies.grid_transport import is_simulation_grid
from lensemble_flwr.strategies.records import PREFIX

ENGINE_TICK = 0.1
"""Flower 1.42's simulation engine looks for new instructions every 0.1 s (vce_api.py)."""
CLIENT_RECORD = "bench.client"
"""The ConfigRecord in which each train reply carries its ClientApp seconds."""


# -- the ClientApp (runs inside the Ray actors) -------------------------------------------
class TinyModel(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(size))


class TinyTrainer:
    """One parameter ``w``; loss ``-w.sum()`` (gradient -1: one AdamW step adds ~lr)."""

    def __init__(self, index: int, size: int) -> None:
        self.index = index
        self.model = TinyModel(size)

    def num_examples(self) -> int:
        return 1

    def dataset_records(self) -> Iterator[bytes]:
        yield self.index.to_bytes(4, "little")

    def sample_batch(self, generator: torch.Generator, batch_size: int) -> Any:
        return None

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return -model.w.sum()


def timeout_for(nodes: int) -> float:
    """Seconds to wait for N nodes' answers (warm-up, a round's collection): 120 s, or
    more for N above 120 (a round of 500 nodes on 2 loaded cores takes tens of seconds)."""
    return max(120.0, float(nodes))


def bench_config(nodes: int) -> LensembleConfig:
    collect = timeout_for(nodes)
    return LensembleConfig(
        federation={"min_participants": nodes, "open_timeout": 60.0, "collect_timeout": collect},
        inner={"steps": 1, "batch_size": 1},
        groups={"shared": "*", "local": ""},
    )


def stock_train(msg: Message, context: Context) -> Message:
    """A stock Message-API train function: the arrays plus a constant, one example."""
    arrays = msg.content["arrays"]
    out = ArrayRecord({k: Array(v.numpy() + np.float32(1.0)) for k, v in arrays.items()})
    content = RecordDict({"arrays": out, "metrics": MetricRecord({"num-examples": 1})})
    return Message(content=content, reply_to=msg)


def stock_torch_train(msg: Message, context: Context) -> Message:
    """A stock Message-API train function shaped like quickstart-pytorch's, doing the same
    training as a lensemble participant here: a fresh :class:`TinyModel` loads the arrays,
    one AdamW step (lr 1e-3, lensemble's inner default) on ``-w.sum()``, the model's
    state dict back, one example."""
    arrays = msg.content["arrays"]
    model = TinyModel(int(arrays["w"].shape[0]))
    model.load_state_dict(arrays.to_torch_state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.zero_grad()
    (-model.w.sum()).backward()
    optimizer.step()
    out = ArrayRecord(model.state_dict())
    content = RecordDict({"arrays": out, "metrics": MetricRecord({"num-examples": 1})})
    return Message(content=content, reply_to=msg)


STOCK_TRAINS = {"add-one": stock_train, "torch": stock_torch_train}
"""What FedAvg's train function does (``--stock-train``)."""
STOCK_STEP = {"add-one": 1.0, "torch": 1e-3}
"""How far each stock train function moves ``w`` per round (one AdamW step: lr)."""


def is_lensemble_instruction(content: RecordDict) -> bool:
    config = content.config_records.get("config")
    return config is not None and PREFIX + "kind" in config


def bench_client_app(
    size: int, config: LensembleConfig, stock: str = "add-one"
) -> ClientApp:
    """Routes a train instruction to a lensemble participant (``make_client_app``) or to
    the stock train function ``STOCK_TRAINS[stock]``, and stamps the reply with the
    seconds that took."""
    stock_fn = STOCK_TRAINS[stock]
    lensemble = make_client_app(
        lambda ctx: TinyTrainer(int(ctx.node_config["partition-id"]), size),
        config_fn=lambda ctx: config,
        evaluate_fn=None,
    )
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        start, t0 = time.time(), time.perf_counter()
        live = process_participants()
        hits, stale = live.hits, live.stale
        if is_lensemble_instruction(msg.content):
            reply = lensemble(msg, context)
        else:
            reply = stock_fn(msg, context)
        if not reply.has_error():
            reply.content[CLIENT_RECORD] = ConfigRecord(
                {
                    "seconds": time.perf_counter() - t0,
                    "start": start,
                    "end": time.time(),
                    "reused": int(live.hits > hits),  # a kept participant, as it was
                    "refreshed": int(live.stale > stale),  # one given the state saved elsewhere
                }
            )
        return reply

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return lensemble(msg, context)  # the warm-up query of LensembleStrategy (and ours)

    return app


# -- the ServerApp side -------------------------------------------------------------------
class StoreWrites:
    """Wall seconds and count of ``Store._publish`` calls (each writes a temp file,
    fsyncs it, renames or links it, fsyncs the directory): the coordinator's checkpoint,
    ledger and manifest writes. Only LensembleStrategy writes; FedAvg never calls it."""

    seconds = 0.0
    calls = 0

    @classmethod
    def install(cls) -> Callable[[], None]:
        original = Store._publish

        @functools.wraps(original)
        def timed(self: Store, *args: Any, **kwargs: Any) -> bool:
            t0 = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                cls.seconds += time.perf_counter() - t0
                cls.calls += 1

        Store._publish = timed  # type: ignore[method-assign]

        def restore() -> None:
            Store._publish = original  # type: ignore[method-assign]

        return restore


@dataclasses.dataclass
class RoundMarks:
    """What the Grid proxy saw of one round (``time.time()`` stamps unless noted)."""

    pushed: float  # the round's train instructions handed to the Grid
    perf: float  # same moment, time.perf_counter()
    cpu: float  # same moment, the ServerApp thread's CPU time
    store_seconds: float  # same moment, StoreWrites.seconds
    store_calls: int  # same moment, StoreWrites.calls
    replies: int = 0
    client_seconds: float = 0.0  # the train calls' seconds inside the actors, summed
    reused: int = 0  # train calls answered by a participant kept alive in the actor
    refreshed: int = 0  # ... by a kept one that loaded a state another actor saved
    first_start: float = float("inf")  # earliest train call start (inside an actor)
    last_end: float = 0.0  # latest train call end
    last_pull: float = 0.0  # when the last train reply reached the ServerApp thread
    paused: float = 0.0  # the bench's pause just before this push (not the strategy's)


def now_marks() -> RoundMarks:
    return RoundMarks(
        time.time(), time.perf_counter(), time.thread_time(), StoreWrites.seconds, StoreWrites.calls
    )


class TimedGrid:
    """A Grid proxy that marks the push of every round's train instructions and notes
    what the train replies pulled after it carry (see :class:`RoundMarks`)."""

    def __init__(self, grid: Grid, pauses: random.Random | None = None) -> None:
        self._grid = grid
        self.rounds: list[RoundMarks] = []
        self._pauses = pauses  # a random pause before every train push (``--phase round``)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def _mark(self, messages: list[Message]) -> None:
        if any(m.metadata.message_type == MessageType.TRAIN for m in messages):
            paused = 0.0
            if self._pauses is not None:  # the push lands at a random phase of the tick
                paused = self._pauses.uniform(0.0, ENGINE_TICK)
                time.sleep(paused)
            self.rounds.append(dataclasses.replace(now_marks(), paused=paused))

    def _count(self, replies: Iterable[Message]) -> list[Message]:
        replies = list(replies)
        now = time.time()
        for reply in replies:
            if reply.metadata.message_type != MessageType.TRAIN or not self.rounds:
                continue
            if reply.has_error() or CLIENT_RECORD not in reply.content.config_records:
                continue
            stamp, marks = reply.content.config_records[CLIENT_RECORD], self.rounds[-1]
            marks.replies += 1
            marks.client_seconds += float(stamp["seconds"])  # type: ignore[arg-type]
            marks.reused += int(stamp["reused"])  # type: ignore[arg-type]
            marks.refreshed += int(stamp["refreshed"])  # type: ignore[arg-type]
            start, stop = float(stamp["start"]), float(stamp["end"])  # type: ignore[arg-type]
            marks.first_start = min(marks.first_start, start)
            marks.last_end = max(marks.last_end, stop)
            marks.last_pull = now
        return replies

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        self._mark(messages)
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._count(self._grid.pull_messages(message_ids))

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        messages = list(messages)
        self._mark(messages)
        return self._count(self._grid.send_and_receive(messages, timeout=timeout))


@dataclasses.dataclass(frozen=True)
class Variant:
    strategy: str  # "FedAvg" or "LensembleStrategy"
    poll: float

    @property
    def name(self) -> str:
        return f"{self.strategy} @ {self.poll:.2f} s"


PHASES = {
    "dispatch": "push -> first train call starts in an actor (VCE extractor tick, Ray)",
    "clients": "first train call starts -> last one ends (N calls on the actors)",
    "pickup": "last train call ends -> its reply reaches the ServerApp (injector, Grid poll)",
    "server": "last reply in -> next round's push (aggregate, commit, next instructions)",
}


@dataclasses.dataclass
class Measured:
    """Per measured round: wall seconds, ServerApp-thread CPU, ClientApp seconds (sum),
    and the round's timeline split into :data:`PHASES`."""

    wall: list[float] = dataclasses.field(default_factory=list)
    server_cpu: list[float] = dataclasses.field(default_factory=list)
    client: list[float] = dataclasses.field(default_factory=list)
    messages: list[int] = dataclasses.field(default_factory=list)
    store_seconds: list[float] = dataclasses.field(default_factory=list)
    store_calls: list[int] = dataclasses.field(default_factory=list)
    phases: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: {name: [] for name in PHASES}
    )
    coordinator_seconds: list[float] = dataclasses.field(default_factory=list)
    block_means: list[float] = dataclasses.field(default_factory=list)  # one per block
    reused: int = 0
    refreshed: int = 0


def run_block(
    grid: Grid,
    variant: Variant,
    rounds: int,
    nodes: int,
    size: int,
    run_dir: Path,
    run_id: str,
    profiler: cProfile.Profile | None = None,
    stock: str = "add-one",
    durable_writes: bool | None = None,
    pauses: random.Random | None = None,
) -> tuple[TimedGrid, RoundMarks, list[float]]:
    """``rounds`` rounds of ``variant``; (proxy with the push marks, end mark, the
    coordinator's own per-round seconds for LensembleStrategy). With ``pauses``, every
    train push waits a random part of an engine tick first (not counted)."""
    proxy = TimedGrid(grid, pauses)
    initial = ArrayRecord({"w": Array(np.zeros(size, np.float32))})
    own: list[float] = []
    if profiler is not None:
        profiler.enable()
    try:
        if variant.strategy == "FedAvg":
            saved = grid.pull_interval  # type: ignore[attr-defined]
            grid.pull_interval = variant.poll  # type: ignore[attr-defined]
            try:
                strategy = FedAvg(
                    fraction_evaluate=0.0, min_available_nodes=nodes, min_train_nodes=nodes
                )
                result = strategy.start(
                    grid=proxy,
                    initial_arrays=initial,  # type: ignore[arg-type]
                    num_rounds=rounds,
                )
            finally:
                grid.pull_interval = saved  # type: ignore[attr-defined]
            end = now_marks()
            final = result.arrays["w"].numpy()
            expected = rounds * STOCK_STEP[stock]
            if not np.allclose(final, expected, rtol=1e-3):
                raise RuntimeError(f"FedAvg: w = {final[:3]}..., expected {expected:g}")
        else:
            lens = LensembleStrategy(
                bench_config(nodes),
                run_dir=run_dir,
                run_id=run_id,
                fraction_evaluate=0.0,
                poll_interval=variant.poll,
                warmup_timeout=timeout_for(nodes),
                # the proxy is no InMemoryGrid: decide as the strategy does on the real grid
                durable_writes=(
                    durable_writes if durable_writes is not None else not is_simulation_grid(grid)
                ),
            )
            result = lens.start(
                grid=proxy,
                initial_arrays=initial,  # type: ignore[arg-type]
                num_rounds=rounds,
            )
            end = now_marks()
            for rnd, metrics in sorted(result.train_metrics_clientapp.items()):
                if metrics["lensemble.C_t"] != nodes or metrics["lensemble.exchanges"] != 1:
                    raise RuntimeError(f"lensemble round {rnd}: {dict(metrics)}")
                own.append(float(metrics["lensemble.seconds"]))
    finally:
        if profiler is not None:
            profiler.disable()
    replies = [m.replies for m in proxy.rounds]
    if len(replies) != rounds or any(n != nodes for n in replies):
        raise RuntimeError(
            f"{variant.name}: {len(replies)} train pushes for {rounds} "
            f"rounds, train replies per round {replies}"
        )
    return proxy, end, own


def record_block(
    measured: Measured,
    proxy: TimedGrid,
    end: RoundMarks,
    own: list[float],
    discard: int,
) -> None:
    """Add the block's rounds after the first ``discard`` to ``measured``."""
    marks = [*proxy.rounds, end]
    # a round runs from its push to the next round's; the bench's pause before that push
    # is not the round's
    walls = [
        marks[r + 1].perf - marks[r].perf - marks[r + 1].paused
        for r in range(discard, len(proxy.rounds))
    ]
    measured.block_means.append(statistics.fmean(walls))
    for r in range(discard, len(proxy.rounds)):
        m, nxt = marks[r], marks[r + 1]
        measured.wall.append(walls[r - discard])
        measured.server_cpu.append(nxt.cpu - m.cpu)
        measured.client.append(m.client_seconds)
        measured.reused += m.reused
        measured.refreshed += m.refreshed
        measured.messages.append(m.replies)
        measured.store_seconds.append(nxt.store_seconds - m.store_seconds)
        measured.store_calls.append(nxt.store_calls - m.store_calls)
        timeline = {
            "dispatch": m.first_start - m.pushed,
            "clients": m.last_end - m.first_start,
            "pickup": m.last_pull - m.last_end,
            "server": nxt.pushed - nxt.paused - m.last_pull,
        }
        for name, seconds in timeline.items():
            measured.phases[name].append(seconds)
    measured.coordinator_seconds.extend(own[discard:])


def warm_up_nodes(grid: Grid, nodes: int, timeout: float) -> float:
    """Wait until ``nodes`` nodes are connected and each answered a query; seconds."""
    t0 = time.perf_counter()
    while len(list(grid.get_node_ids())) < nodes:
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError("nodes did not connect")
        time.sleep(0.2)
    messages = [
        Message(
            RecordDict({"bench.ping": ConfigRecord({"ping": 1})}),
            dst_node_id=node,
            message_type=MessageType.QUERY,
        )
        for node in grid.get_node_ids()
    ]
    replies = list(grid.send_and_receive(messages, timeout=timeout))
    if len(replies) != nodes or any(r.has_error() for r in replies):
        raise RuntimeError(f"warm-up: {len(replies)} replies from {nodes} nodes")
    return time.perf_counter() - t0


def bench_server_app(args: argparse.Namespace, variants: list[Variant], out: dict) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        logging.getLogger("flwr").setLevel(logging.WARNING)  # no per-round INFO lines
        try:
            with tempfile.TemporaryDirectory(prefix="bench-flower-round-") as tmp:
                out["warm-up"] = warm_up_nodes(grid, args.n, timeout=timeout_for(args.n))
                t0 = time.perf_counter()
                for strategy in ("FedAvg", "LensembleStrategy"):  # untimed, one block each
                    run_block(
                        grid,
                        Variant(strategy, 0.1),
                        args.discard + 1,
                        args.n,
                        args.size,
                        Path(tmp) / f"warm-{strategy}",
                        f"warm-{strategy}",
                        stock=args.stock_train,
                        durable_writes=args.durable_writes,
                    )
                out["warm-blocks"] = time.perf_counter() - t0
                measured = {v: Measured() for v in variants}
                profilers = {v: cProfile.Profile() for v in variants} if args.profile else {}
                t0 = time.perf_counter()
                phases = random.Random(args.phase_seed)  # see "Phase" in the docstring
                for block in range(args.blocks):
                    k = block % len(variants)
                    for i, v in enumerate(variants[k:] + variants[:k]):
                        run_id = f"bench-{block}-{i}"
                        if args.phase == "block":
                            time.sleep(phases.uniform(0.0, ENGINE_TICK))
                        proxy, end, own = run_block(
                            grid,
                            v,
                            args.rounds,
                            args.n,
                            args.size,
                            Path(tmp) / run_id,
                            run_id,
                            profilers.get(v),
                            stock=args.stock_train,
                            durable_writes=args.durable_writes,
                            pauses=phases if args.phase == "round" else None,
                        )
                        record_block(measured[v], proxy, end, own, args.discard)
                out["blocks"] = time.perf_counter() - t0
                out["measured"] = measured
                out["profilers"] = profilers
        except BaseException as exc:  # handed back to the main thread, which reports it
            out["error"] = "".join(traceback.format_exception(exc))

    return app


# -- report -------------------------------------------------------------------------------
def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def print_profile(variant: Variant, profiler: cProfile.Profile, rounds: int, top: int) -> None:
    """Top functions of the ServerApp thread by own time, then the package's by cumulative
    time, per round (the blocks' first rounds and ``start`` set-up included)."""
    stats = pstats.Stats(profiler)
    raw: dict[tuple[str, int, str], tuple[Any, ...]] = stats.stats  # type: ignore[attr-defined]

    def table(title: str, rows: list[tuple[tuple[str, int, str], tuple[Any, ...]]]) -> None:
        print(title)
        print(f"{'calls/rnd':>10}{'own ms/rnd':>11}{'cum ms/rnd':>11}  function")
        for (filename, line, func), (_cc, ncalls, tottime, cumtime, _callers) in rows[:top]:
            where = func if filename == "~" else f"{_short(filename)}:{line}({func})"
            print(
                f"{ncalls / rounds:>10.1f}{tottime / rounds * 1e3:>11.2f}"
                f"{cumtime / rounds * 1e3:>11.2f}  {where}"
            )

    print(
        f"\n== cProfile of the ServerApp thread, {variant.name}, per round over {rounds} "
        "rounds (cProfile inflates call-heavy code: read shares, not absolute times)"
    )
    table("by own time:", sorted(raw.items(), key=lambda kv: -kv[1][2]))
    own = [kv for kv in raw.items() if os.sep + "lensemble_flwr" + os.sep in kv[0][0]]
    if own:
        table("lensemble_flwr functions by cumulative time:", sorted(own, key=lambda kv: -kv[1][3]))


def _short(filename: str) -> str:
    for marker in ("site-packages" + os.sep, os.sep + "lensemble_flwr" + os.sep):
        if marker in filename:
            head = "" if marker.startswith("site") else "lensemble_flwr" + os.sep
            return head + filename.split(marker, 1)[1]
    return os.path.basename(filename)


def ratio_error(lens: Measured, fed: Measured) -> float:
    """Standard error of mean(lens) / mean(fed) from the blocks' means (first-order
    propagation). The two variants ran in the same blocks, one after the other, so their
    block means are paired and their covariance enters (a block slowed by the machine
    slows both). NaN with fewer than two blocks."""
    a, b = lens.block_means, fed.block_means
    n = min(len(a), len(b))
    if n < 2:
        return float("nan")
    a, b = a[:n], b[:n]
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True)) / (n - 1)
    rel = statistics.variance(a) / ma**2 + statistics.variance(b) / mb**2 - 2 * cov / (ma * mb)
    return ma / mb * (max(rel, 0.0) / n) ** 0.5


def per_message(measured: Iterable[Measured]) -> float:
    """Mean seconds of one train call inside an actor, over every measured round."""
    measured = list(measured)
    calls = sum(sum(m.messages) for m in measured)
    return sum(sum(m.client) for m in measured) / calls if calls else float("nan")


def report(args: argparse.Namespace, variants: list[Variant], out: dict, total: float) -> dict:
    """Print one N's tables; return its verdict figures (see :func:`print_verdicts`)."""
    measured: dict[Variant, Measured] = out["measured"]
    print(
        f"\nRay start-up + node warm-up, not measured: {total - out['blocks']:.1f} s in all "
        f"(query warm-up {out['warm-up']:.1f} s, untimed blocks {out['warm-blocks']:.1f} s); "
        f"timed blocks {out['blocks']:.1f} s"
    )
    print(
        f"\n{'variant (poll = Grid pull interval)':<36}{'rounds':>7}{'median':>8}{'mean':>7}"
        f"{'min':>7}{'p90':>7}{'<=1 tick':>9}{'server CPU':>11}{'ClientApp':>10}"
    )
    for v in variants:
        m = measured[v]
        p90 = statistics.quantiles(m.wall, n=10)[-1] if len(m.wall) > 1 else float("nan")
        one_tick = sum(w < 1.5 * ENGINE_TICK for w in m.wall) / len(m.wall)
        print(
            f"{v.name:<36}{len(m.wall):>7}{median(m.wall):>8.3f}{statistics.fmean(m.wall):>7.3f}"
            f"{min(m.wall):>7.3f}{p90:>7.3f}{one_tick:>9.0%}{median(m.server_cpu):>11.4f}"
            f"{median(m.client):>10.4f}"
        )
    print(
        f"(seconds per round; <=1 tick = share of rounds shorter than 1.5 x the simulation "
        f"engine's stock {ENGINE_TICK:g} s dispatch tick; server CPU = the ServerApp thread's "
        f"CPU time, median; ClientApp = the {args.n} train calls' seconds inside the "
        f"actors, summed, median; they run {args.actors} at a time)"
    )
    print(
        f"\nwhere a round goes, mean seconds (the four phases add up to the mean wall):\n"
        f"{'variant':<36}{'mean':>7}"
        + "".join(f"{name:>10}" for name in PHASES)
        + f"{'(store writes)':>16}"
    )
    for v in variants:
        m = measured[v]
        writes = statistics.fmean(m.store_calls)
        print(
            f"{v.name:<36}{statistics.fmean(m.wall):>7.3f}"
            + "".join(f"{statistics.fmean(m.phases[name]):>10.3f}" for name in PHASES)
            + f"{statistics.fmean(m.store_seconds):>10.3f} ({writes:.0f})"
        )
    for name, what in PHASES.items():
        print(f"  {name}: {what}")
    print(
        "  (store writes): of the server phase, the coordinator's fsynced Store writes "
        "(checkpoint, ledger record, manifest entry, their names), seconds (count)"
    )
    for v in variants:
        if measured[v].coordinator_seconds:
            own = median(measured[v].coordinator_seconds)
            print(
                f"  {v.name}: the strategy's own 'seconds' metric (RoundOpen to commit, "
                f"excl. the manifest write), median {own:.3f}; train calls answered by "
                f"a participant kept alive in its actor: {measured[v].reused} as it was, "
                f"{measured[v].refreshed} given the state another actor saved, of "
                f"{sum(measured[v].messages)}"
            )

    by = {(v.strategy, v.poll): measured[v] for v in variants}
    comparisons = [(f"equal polls, {p:.2f} s", p, p) for p in args.polls]
    if 0.05 in args.polls and 0.1 in args.polls:
        comparisons.insert(0, ("as shipped (each its default)", 0.05, 0.1))
    print(
        f"\n{'LensembleStrategy / FedAvg':<32}{'lens poll':>10}{'FedAvg poll':>12}"
        f"{'ratio of means':>16}{'+- s.e.':>9}{'of medians':>12}{'of mins':>9}"
    )
    judged = []
    for label, lens_poll, fed_poll in comparisons:
        lens, fed = by[("LensembleStrategy", lens_poll)], by[("FedAvg", fed_poll)]
        ratio = statistics.fmean(lens.wall) / statistics.fmean(fed.wall)
        error = ratio_error(lens, fed)
        of_medians, of_mins = median(lens.wall) / median(fed.wall), min(lens.wall) / min(fed.wall)
        print(
            f"{label:<32}{lens_poll:>9.2f}s{fed_poll:>11.2f}s{ratio:>16.2f}{error:>9.2f}"
            f"{of_medians:>12.2f}{of_mins:>9.2f}"
        )
        if lens_poll == fed_poll:
            judged.append((ratio, label, error))
    print(
        "  +- s.e.: the ratio's standard error from the blocks' means, paired by block (each "
        "block starts at a random phase of the engine's tick)"
    )
    worst, label, worst_error = max(judged)
    client = {
        strategy: per_message(measured[v] for v in variants if v.strategy == strategy)
        for strategy in ("FedAvg", "LensembleStrategy")
    }
    cpu = {
        strategy: statistics.fmean(
            c for v in variants if v.strategy == strategy for c in measured[v].server_cpu
        )
        for strategy in ("FedAvg", "LensembleStrategy")
    }
    means = {v.name: statistics.fmean(measured[v].wall) for v in variants}
    return {
        "nodes": args.n,
        "rounds": {v.name: len(measured[v].wall) for v in variants},
        "means": means,
        "ratio": worst,
        "ratio_label": label,
        "ratio_error": worst_error,
        "client_fedavg": client["FedAvg"],
        "client_lensemble": client["LensembleStrategy"],
        "cpu_fedavg": cpu["FedAvg"],
        "cpu_lensemble": cpu["LensembleStrategy"],
        "load": _load(),
    }


def print_verdicts(results: list[dict], target: float, client_target: float) -> None:
    """Issue 13's two targets at every N: seconds per round (worst equal-poll ratio of
    means) and ClientApp seconds per train message, LensembleStrategy / FedAvg."""
    print(
        f"\n== summary (ratios LensembleStrategy / FedAvg)\n{'N':>5}{'round ratio':>13}"
        f"{'ClientApp ms/msg L':>20}{'F':>7}{'ratio':>7}{'server CPU ms/rnd L':>21}{'F':>7}"
        f"  load at end"
    )
    for r in results:
        print(
            f"{r['nodes']:>5}{r['ratio']:>13.2f}{r['client_lensemble'] * 1e3:>20.2f}"
            f"{r['client_fedavg'] * 1e3:>7.2f}"
            f"{r['client_lensemble'] / r['client_fedavg']:>7.1f}"
            f"{r['cpu_lensemble'] * 1e3:>21.1f}{r['cpu_fedavg'] * 1e3:>7.1f}  {r['load']}"
        )
    for r in results:
        ratio = r["ratio"]
        print(
            f"{'PASS' if ratio <= target else 'FAIL'}: N = {r['nodes']}: seconds per round "
            f"<= {target:g} x FedAvg's at equal polls: worst ratio of means {ratio:.2f} "
            f"+- {r.get('ratio_error', float('nan')):.2f} ({r['ratio_label']})"
        )
        client = r["client_lensemble"] / r["client_fedavg"]
        print(
            f"{'PASS' if client <= client_target else 'FAIL'}: N = {r['nodes']}: ClientApp "
            f"seconds per train message <= {client_target:g} x FedAvg's: {client:.1f} x "
            f"({r['client_lensemble'] * 1e3:.2f} ms vs {r['client_fedavg'] * 1e3:.2f} ms)"
        )


def patch_extractor_tick(tick: float) -> None:
    """Diagnostic only: replace the simulation engine's hard-coded 0.1 s wait between two
    looks for new instructions (``vce_api.add_messages_to_queue``) by ``tick``."""
    from flwr.server.superlink.fleet.vce import vce_api

    def add_messages_to_queue(state: Any, queue: Any, nodes_mapping: Any, f_stop: Any) -> None:
        while not f_stop.is_set():
            for node_id in nodes_mapping:
                for message in state.get_message_ins(node_id=node_id, limit=1):
                    queue.put(message)
            f_stop.wait(tick)

    vce_api.add_messages_to_queue = add_messages_to_queue


def _load() -> str:
    """The 1/5/15-minute load averages (other jobs on the machine skew the timings)."""
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


SCHEDULE = {10: (41, 4, [0.1, 0.05]), 50: (13, 4, [0.1, 0.05]), 200: (5, 2, [0.1])}
"""Per N (up to the key): default rounds per block, blocks and polls; larger N:
:data:`LARGE_SCHEDULE`. Fewer rounds at large N keep a run on 2 cores within minutes
(a round of 500 nodes takes seconds)."""
LARGE_SCHEDULE = (3, 2, [0.1])


def schedule(args: argparse.Namespace, nodes: int) -> argparse.Namespace:
    """``args`` for one N: its rounds, blocks and polls unless given on the command line."""
    rounds, blocks, polls = next(
        (plan for limit, plan in sorted(SCHEDULE.items()) if nodes <= limit), LARGE_SCHEDULE
    )
    one = argparse.Namespace(**vars(args))
    one.n = nodes
    one.rounds = args.rounds if args.rounds is not None else rounds
    one.blocks = args.blocks if args.blocks is not None else blocks
    one.polls = args.polls if args.polls is not None else polls
    return one


def run_one(args: argparse.Namespace) -> dict | None:
    """One ``run_simulation`` of ``args.n`` supernodes; its report, and verdict figures
    (None if the simulation failed)."""
    cores = os.cpu_count() or 1
    args.actors = max(1, int(cores / args.num_cpus))
    variants = [Variant(s, p) for p in args.polls for s in ("FedAvg", "LensembleStrategy")]
    import flwr
    import ray

    print(
        f"== Flower simulation round time: {args.n} supernodes, FedAvg train: {args.stock_train}, "
        f"model = one float32 "
        f"array of {args.size}, {args.blocks} blocks x {args.rounds} rounds per variant "
        f"({args.discard} discarded per block), polls {args.polls}, num_cpus="
        f"{args.num_cpus:g} per ClientApp ({args.actors} actors on {cores} cores); flwr "
        f"{flwr.__version__}, ray {ray.__version__}, torch {torch.__version__}, Python "
        f"{sys.version.split()[0]}{' [cProfile on]' if args.profile else ''}; load average "
        f"{_load()}",
        flush=True,
    )
    if args.extractor_tick != ENGINE_TICK:
        patch_extractor_tick(args.extractor_tick)
        print(
            f"!! diagnostic run: the engine's dispatch tick is patched to "
            f"{args.extractor_tick:g} s (stock {ENGINE_TICK} s)"
        )
    if args.durable_writes:
        print("LensembleStrategy(durable_writes=True): the run directory's writes are fsynced")
    out: dict = {}
    t0 = time.perf_counter()
    restore = StoreWrites.install()
    try:
        run_simulation(
            server_app=bench_server_app(args, variants, out),
            client_app=bench_client_app(args.size, bench_config(args.n), args.stock_train),
            num_supernodes=args.n,
            backend_config={"client_resources": {"num_cpus": args.num_cpus, "num_gpus": 0.0}},
        )
    except Exception:
        out.setdefault("error", traceback.format_exc())
    finally:
        restore()
    total = time.perf_counter() - t0
    if "error" in out or "measured" not in out:
        print(f"FAIL: the simulation did not complete:\n{out.get('error', 'no result')}")
        return None
    result = report(args, variants, out, total)
    if args.profile:
        for v, profiler in out["profilers"].items():
            print_profile(v, profiler, args.blocks * args.rounds, args.top)
    print(f"total wall {total:.1f} s; load average now {_load()}", flush=True)
    return result


def without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` less ``option`` and its values (``--nodes 10 50`` or ``--nodes=10``)."""
    kept: list[str] = []
    skipping = False
    for arg in argv:
        if arg == option:
            skipping = True
        elif arg.startswith(option + "="):
            skipping = False
        elif skipping and not arg.startswith("-"):
            continue
        else:
            skipping = False
            kept.append(arg)
    return kept


def run_children(args: argparse.Namespace, argv: list[str]) -> list[dict | None]:
    """One child process per N (a fresh Ray and ServerApp each), streaming its report;
    the verdict figures come back through a JSON file."""
    passed = without_option(argv, "--nodes")
    results: list[dict | None] = []
    for nodes in args.nodes:
        with tempfile.TemporaryDirectory(prefix="bench-flower-round-") as tmp:
            path = Path(tmp) / "result.json"
            command = [sys.executable, __file__, *passed, "--nodes", str(nodes)]
            code = subprocess.call([*command, "--result-file", str(path)])
            ok = code == 0 and path.exists()
            results.append(json.loads(path.read_text()) if ok else None)
            if not ok:
                print(f"FAIL: N = {nodes}: no result (the run above failed; exit code {code})")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--nodes",
        type=int,
        nargs="+",
        default=[10, 50, 200, 500],
        help="supernodes (participants); several: one simulation each, then the summary",
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds per block (default: by N, SCHEDULE)"
    )
    parser.add_argument(
        "--discard", type=int, default=1, help="rounds at the start of every block not measured"
    )
    parser.add_argument(
        "--blocks", type=int, default=None, help="blocks of each variant (default: by N)"
    )
    parser.add_argument("--size", type=int, default=100, help="float32 values in the model")
    parser.add_argument(
        "--stock-train",
        choices=sorted(STOCK_TRAINS),
        default="add-one",
        help="FedAvg's train function: add-one (arrays + 1, no training) or torch (the "
        "same one AdamW step as the lensemble participant, quickstart-pytorch's shape)",
    )
    parser.add_argument(
        "--num-cpus",
        type=float,
        default=1.0,
        help="client_resources num_cpus (Ray runs cores/num_cpus actors)",
    )
    parser.add_argument(
        "--polls",
        type=float,
        nargs="+",
        default=None,
        help="Grid pull intervals to run each strategy at (default: by N)",
    )
    parser.add_argument(
        "--target", type=float, default=1.1, help="seconds per round, x FedAvg's (issue 13)"
    )
    parser.add_argument(
        "--client-target",
        type=float,
        default=2.0,
        help="ClientApp seconds per train message, x FedAvg's (issue 13)",
    )
    parser.add_argument(
        "--extractor-tick",
        type=float,
        default=ENGINE_TICK,
        help="diagnostic: patch the simulation engine's dispatch tick "
        f"(stock: {ENGINE_TICK} s, hard-coded in flwr's vce_api)",
    )
    parser.add_argument(
        "--durable-writes",
        action="store_const",
        const=True,
        default=None,
        help="LensembleStrategy(durable_writes=True): fsync every write to the run "
        "directory, as on a deployment (default: the strategy's default on the engine, "
        "no fsync)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the ServerApp thread during the timed blocks",
    )
    parser.add_argument(
        "--phase",
        choices=("block", "fixed", "round"),
        default="block",
        help="where the bench pauses a random part of an engine tick (not counted): "
        "before every block (default), nowhere, or before every round's push (a "
        "diagnostic: it draws every round's phase uniformly, which a run's rounds, "
        "locked to the tick, do not do; see the module docstring)",
    )
    parser.add_argument(
        "--phase-seed", type=int, default=0, help="seed of the random pauses (--phase)"
    )
    parser.add_argument("--top", type=int, default=25, help="cProfile rows")
    parser.add_argument("--result-file", type=Path, default=None, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.nodes):
        parser.error("--nodes must be positive")
    for nodes in args.nodes:
        if schedule(args, nodes).rounds <= args.discard:
            parser.error("--rounds must exceed --discard")
    if len(args.nodes) > 1:
        results = run_children(args, argv)
    else:
        results = [run_one(schedule(args, args.nodes[0]))]
        if args.result_file is not None:  # a child: the parent prints the summary
            if results[0] is None:
                return 1
            args.result_file.write_text(json.dumps(results[0]))
            return 0
    done = [r for r in results if r is not None]
    if done:
        print_verdicts(done, args.target, args.client_target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
