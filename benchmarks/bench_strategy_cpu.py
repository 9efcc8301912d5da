"""Benchmark: CPU per round of LensembleStrategy against FedAvg, without Ray.

Run ``python benchmarks/bench_strategy_cpu.py`` (``--help`` for sizes; ~1 minute). The
simulation-engine benchmark (``bench_flower_round.py``) times whole rounds, which Ray's
dispatch and the machine's load dominate at small N; this one takes the engine out. Both
strategies drive the ClientApp of ``bench_flower_round.py`` (FedAvg: its torch train
function; LensembleStrategy: a ``make_client_app`` participant doing the same AdamW step)
through a Grid that calls the app in the ServerApp's thread as each message is pushed.
It measures, per round:

* the ServerApp's CPU (the process CPU minus the ClientApp calls'): building and pushing
  instructions, pulling replies, aggregation, and for lensemble the commit (checkpoint,
  ledger record, manifest entry; no fsync, as on the simulation engine);
* the ClientApp's CPU per train message;
* the server phase: wall seconds from the pull that brings a round's last reply to the
  push of the next round's train instructions (what a round adds to the engine's
  critical path, between the nodes' work of two rounds).

On the simulation engine half the train messages reach an actor that did not handle the
node's previous message, so the participant that actor kept loads the state the other
actor saved in ``context.state`` (*stale*); ``--stale`` sets the share of messages whose
kept participant is made stale first (default 0.5), ``--rebuild`` the share whose kept
participant is dropped, so that it is rebuilt (default 0). Variants are interleaved
over ``--repeats`` runs of ``--rounds`` rounds; the best run of each is reported with the
ratios, for information (no target: the targets are the engine's, in
``bench_flower_round.py``).
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp.strategy import FedAvg

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_flower_round as engine  # the same ClientApp and config
from bench_learning import LoopbackGrid, as_server_app  # a Grid that calls the apps

from lensemble_flwr.clients.live import process_participants
from lensemble_flwr.strategies import LensembleStrategy

SIZE = 100  # float32 values in the model, as in bench_flower_round.py


class TimedApp:
    """The ClientApp, called as ``app(message, context)`` by bench_learning's
    :class:`LoopbackGrid`, with its CPU time added up; before a share ``miss`` of the
    calls it makes the node's kept participant stale, as if another actor had handled the
    node's last message, and before a share ``rebuild`` it drops it."""

    def __init__(self, app: Any, stale: float, rebuild: float = 0.0, seed: int = 0) -> None:
        self.app, self.stale, self.rebuild = app, stale, rebuild
        self.cpu = 0.0
        self._rng = random.Random(seed)

    def __call__(self, message: Message, context: Context) -> Message:
        draw, key, live = (
            self._rng.random(),
            (context.run_id, context.node_id),
            process_participants(),
        )
        if draw < self.rebuild:
            live.take(key, None)
        elif draw < self.rebuild + self.stale:
            kept, _ = live.take_any(key, "")
            if kept is not None:
                live.keep(key, "another actor's token", kept, 0)
        t0 = time.process_time()
        try:
            return self.app(message, context)
        finally:
            self.cpu += time.process_time() - t0


class PhaseTimedGrid(LoopbackGrid):
    """A LoopbackGrid that times the server phase: from the pull that returns the last
    reply a round's train instructions are owed to the next push of train instructions."""

    def __init__(self, apps: dict) -> None:
        super().__init__(apps)
        self.server_phases: list[float] = []
        self._owed = 0  # train replies not pulled yet
        self._last_reply_at: float | None = None

    def push_messages(self, messages: Any) -> list[str]:
        batch = list(messages)
        trains = sum(1 for m in batch if m.metadata.message_type == MessageType.TRAIN)
        if trains and self._last_reply_at is not None:
            self.server_phases.append(time.perf_counter() - self._last_reply_at)
            self._last_reply_at = None
        ids = super().push_messages(batch)
        self._owed += trains
        return ids

    def pull_messages(self, message_ids: Any) -> list[Message]:
        replies = super().pull_messages(message_ids)
        trains = sum(1 for m in replies if m.metadata.message_type == MessageType.TRAIN)
        self._owed -= trains
        if trains and self._owed <= 0:
            self._last_reply_at = time.perf_counter()
        return replies


def loopback(app: TimedApp, nodes: int) -> PhaseTimedGrid:
    """A LoopbackGrid of ``nodes`` nodes, each with its own Context (its state kept between
    messages, as a SuperNode does), all answering with ``app``."""
    return PhaseTimedGrid(
        {
            node: (
                app,
                Context(
                    run_id=1,
                    node_id=node,
                    node_config={"partition-id": i},
                    state=RecordDict(),
                    run_config={},
                ),
            )
            for i, node in enumerate(range(1001, 1001 + nodes))
        }
    )


def run_once(
    strategy: str, app: TimedApp, grid: PhaseTimedGrid, nodes: int, rounds: int, run_dir: Path
) -> dict:
    """``rounds`` rounds of ``strategy``: ServerApp CPU per round, ClientApp CPU per message,
    and the median server phase."""
    initial = ArrayRecord({"w": Array(np.zeros(SIZE, np.float32))})
    app.cpu = 0.0
    grid.server_phases.clear()
    cpu0 = time.process_time()
    if strategy == "FedAvg":
        FedAvg(fraction_evaluate=0.0, min_available_nodes=nodes, min_train_nodes=nodes).start(
            grid=grid, initial_arrays=initial, num_rounds=rounds
        )
    else:
        LensembleStrategy(
            engine.bench_config(nodes),
            run_dir=run_dir,
            run_id=f"cpu-{uuid.uuid4().hex[:8]}",
            fraction_evaluate=0.0,
            poll_interval=0.001,  # its loopback Grid answers at once: no pull waits
            warmup_timeout=10.0,
            durable_writes=False,
        ).start(grid=grid, initial_arrays=initial, num_rounds=rounds)
    cpu = time.process_time() - cpu0
    return {
        "server_ms_per_round": 1e3 * (cpu - app.cpu) / rounds,
        "client_ms_per_message": 1e3 * app.cpu / (rounds * nodes),
        "server_phase_ms": 1e3 * statistics.median(grid.server_phases[1:] or [float("nan")]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stale", type=float, default=0.5, help="share of stale participants")
    parser.add_argument("--rebuild", type=float, default=0.0, help="share of rebuilds")
    args = parser.parse_args(argv)
    logging.getLogger("flwr").setLevel(logging.ERROR)
    as_server_app()  # what a ServerApp process sets before its strategy builds Messages
    print(
        f"== ServerApp and ClientApp CPU per round, no Ray: rounds {args.rounds}, "
        f"best of {args.repeats} runs, stale participants {args.stale:.0%}, rebuilt "
        f"{args.rebuild:.0%}"
    )
    print(
        f"{'N':>5} {'strategy':<18}{'server ms/round':>16}{'client ms/msg':>15}"
        f"{'server phase ms':>17}"
    )
    with tempfile.TemporaryDirectory(prefix="bench-strategy-cpu-") as tmp:
        for nodes in args.nodes:
            app = TimedApp(
                engine.bench_client_app(SIZE, engine.bench_config(nodes), "torch"),
                args.stale,
                args.rebuild,
            )
            grid = loopback(app, nodes)
            for name in ("FedAvg", "LensembleStrategy"):  # warm-up: imports, first AdamW
                run_once(name, app, grid, nodes, 2, Path(tmp) / f"warm-{name}-{nodes}")
            runs: dict[str, list[dict]] = {"FedAvg": [], "LensembleStrategy": []}
            for repeat in range(args.repeats):
                for name in runs:
                    path = Path(tmp) / f"{name}-{nodes}-{repeat}"
                    runs[name].append(run_once(name, app, grid, nodes, args.rounds, path))
            best = {
                name: {key: min(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()
            }
            for name, figures in best.items():
                print(
                    f"{nodes:>5} {name:<18}{figures['server_ms_per_round']:>16.2f}"
                    f"{figures['client_ms_per_message']:>15.2f}"
                    f"{figures['server_phase_ms']:>17.2f}"
                )
            lens, fedavg = best["LensembleStrategy"], best["FedAvg"]
            print(
                f"{nodes:>5} {'ratio':<18}"
                f"{lens['server_ms_per_round'] / fedavg['server_ms_per_round']:>16.2f}"
                f"{lens['client_ms_per_message'] / fedavg['client_ms_per_message']:>15.2f}"
                f"{lens['server_phase_ms'] / fedavg['server_phase_ms']:>17.2f}"
            )
    print(
        "(server phase: wall time, median over the rounds, from the pull that brings a "
        "round's last reply to the next round's train push)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
