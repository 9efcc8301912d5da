"""Benchmark: the shared-folder mode's CPU per sitting, early in a run and 1,000 rounds in.

Run ``.venv/bin/python benchmarks/bench_shared_folder.py`` (``--rounds``; ~1 minute with
the default 1,000 rounds on 2 cores). One :class:`SharedFolderParticipant` (the toy
trainer, one inner step, unauthenticated) runs ``--rounds`` rounds in a temporary folder;
being the only participant, it deposits and decides every sitting, so every sitting
resumes the coordinator from the run's store, as a decider does. The process's CPU time
is taken between consecutive outcomes.

Target (issue 15): the CPU per sitting does not depend on the rounds already done: the
mean over the last tenth of the sittings is at most 1.2 x the mean over the first tenth
(the first sitting, which creates the run, left out), and the least-squares slope is
printed in microseconds per round. A report, not a test: the exit code is 0 whatever the
outcome.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time

import numpy as np
import torch

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.shared_folder.records import Outcome
from lensemble_flwr.shared_folder.runner import SharedFolderParticipant
from lensemble_flwr.simulations.toy import ToyTrainer, initial_params


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--target", type=float, default=1.2, help="last / first tenth")
    args = parser.parse_args(argv)
    logging.getLogger("lensemble_flwr").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    config = LensembleConfig(
        federation={"min_participants": 1, "root_seed": 0},
        inner={"steps": 1, "lr": 0.02, "weight_decay": 0.0},
        outer={"lr": 0.7, "momentum": 0.9},
    )
    cpu: list[float] = []
    last = [time.process_time()]

    def on_outcome(outcome: Outcome) -> None:
        now = time.process_time()
        cpu.append(now - last[0])
        last[0] = now

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-shared-folder-") as folder:
        node = SharedFolderParticipant(
            folder,
            config=config,
            participant_id="p0",
            trainer=ToyTrainer(0),
            participants=["p0"],
            initial_params=initial_params(),
            run_id="bench",
            unauthenticated=True,
            poll_interval=0.001,
            on_outcome=on_outcome,
        )
        node.run(args.rounds)
    ms = np.array(cpu[1:]) * 1e3  # the first sitting also creates the run
    tenth = max(1, len(ms) // 10)
    first, final = float(ms[:tenth].mean()), float(ms[-tenth:].mean())
    slope = float(np.polyfit(np.arange(len(ms)), ms, 1)[0]) * 1e3  # us per round
    ratio = final / first
    print(
        f"== shared folder, 1 participant, {args.rounds} rounds in "
        f"{time.perf_counter() - started:.0f} s: CPU per sitting {first:.2f} ms over sittings "
        f"2-{tenth + 1}, {final:.2f} ms over the last {tenth}; slope {slope:+.1f} us per round"
    )
    verdict = "PASS" if ratio <= args.target else "FAIL"
    print(
        f"{verdict}: CPU per sitting independent of the rounds done: last / first tenth "
        f"{ratio:.2f} (target <= {args.target:g})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
