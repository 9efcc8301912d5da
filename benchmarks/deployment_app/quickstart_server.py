"""The ServerApp of ``benchmarks/bench_deployment.py``: FedAvg or LensembleStrategy, timed.

It runs ``FedAvg(fraction_evaluate=0.0, ...)`` or ``LensembleStrategy(config,
fraction_evaluate=0.0, ...)`` (``strategy`` in the run config) with the same arguments,
times every round through a thin proxy of the Grid (:class:`TimedGrid`), and writes the
timings and the final model's accuracy on all of digits to ``timings-file``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from quickstart_client import X_ALL, Y_ALL, Net

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.strategies import LensembleStrategy


class TimedGrid:
    """A Grid proxy that records ``time.time()`` whenever train instructions are pushed
    (FedAvg pushes a round's through ``send_and_receive``, LensembleStrategy through
    ``push_messages``). With ``poll > 0`` its ``send_and_receive`` is Flower's (push,
    then pull until every reply is in) with ``poll`` s between pulls instead of the
    deployment Grid's 3 s."""

    def __init__(self, grid: Grid, poll: float) -> None:
        self._grid, self.poll = grid, poll
        self.pushes: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        if any(m.metadata.message_type == MessageType.TRAIN for m in messages):
            self.pushes.append(time.time())
        return self._grid.push_messages(messages)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        if self.poll <= 0:
            messages = list(messages)
            if any(m.metadata.message_type == MessageType.TRAIN for m in messages):
                self.pushes.append(time.time())
            return self._grid.send_and_receive(messages, timeout=timeout)
        waiting = set(self.push_messages(messages))
        end = time.time() + (timeout if timeout is not None else 0.0)
        replies: list[Message] = []
        while timeout is None or time.time() < end:
            got = list(self._grid.pull_messages(waiting))
            replies.extend(got)
            waiting -= {m.metadata.reply_to_message_id for m in got}
            if not waiting:
                break
            time.sleep(self.poll)
        return replies


def accuracy(arrays: ArrayRecord) -> float:
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    model.eval()
    with torch.no_grad():
        return float((model(X_ALL).argmax(1) == Y_ALL).float().mean())


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    run_config = context.run_config
    kind, rounds = str(run_config["strategy"]), int(run_config["num-server-rounds"])
    args = {"fraction_evaluate": 0.0, "min_train_nodes": 2, "min_available_nodes": 2}
    strategy: Any
    if kind == "fedavg":
        strategy = FedAvg(**args)
    elif kind == "lensemble":
        config = LensembleConfig.from_run_config(run_config)
        strategy = LensembleStrategy(config, run_dir=str(run_config["run-dir"]) or None, **args)
    else:
        raise ValueError(f"strategy must be 'fedavg' or 'lensemble', not {kind!r}")
    timed = TimedGrid(grid, float(run_config["poll"]))
    result = strategy.start(
        grid=timed,  # type: ignore[arg-type]
        initial_arrays=ArrayRecord(Net().state_dict()),
        num_rounds=rounds,
        train_config=ConfigRecord({"lr": 0.05}),
    )
    ended = time.time()
    out = {
        "strategy": kind,
        "poll": float(run_config["poll"]),
        "rounds": rounds,
        "pushes": timed.pushes,
        "ended": ended,
        "accuracy": accuracy(result.arrays),
    }
    print(f"bench: {kind} {len(timed.pushes)} train pushes, accuracy {out['accuracy']:.3f}")
    if run_config["timings-file"]:
        Path(str(run_config["timings-file"])).write_text(json.dumps(out))
