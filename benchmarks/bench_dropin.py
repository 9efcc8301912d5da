"""Benchmark: a Flower user's apps, unchanged, with FedAvg and with LensembleStrategy.

Run ``.venv/bin/python benchmarks/bench_dropin.py`` (``--help`` for sizes; ~5-8 minutes
with the defaults on 2 cores). Every app is written the way Flower's quickstarts write
them, on scikit-learn's digits split into non-IID shards (Dirichlet, alpha 0.5):

* ``stock-cnn``: a Message-API ClientApp (``train`` loads ``arrays.to_torch_state_dict()``
  strictly, runs SGD epochs, replies ``arrays`` + ``metrics{train_loss, num-examples}``);
* ``stock-cnn-bn``: the same with a BatchNorm layer (an integer buffer);
* ``numpyclient``: a NumPyClient that sets its weights with ``zip(state_dict().keys(),
  parameters)``. Flower 1.42's Message-API FedAvg cannot drive a legacy
  ``ClientApp(client_fn=...)`` at all (it asks for ``fitins.parameters``), so FedAvg runs
  the stock app here and LensembleStrategy the NumPyClient through ``wrap_numpy_client``;
* ``fixedclipping``: the stock app with Flower's ``fixedclipping_mod``, the strategy
  wrapped in ``DifferentialPrivacyClientSideFixedClipping`` (noise 0.1, clip 1.0);
* ``serverside-dp``: the stock app, the strategy wrapped in
  ``DifferentialPrivacyServerSideFixedClipping`` (noise 0.1, clip 1.0); lensemble trains
  each round from the noised model (its external step, docs/flower.md);
* ``fraction-0.3``: the stock app over 50 nodes with ``fraction_train=0.3``.

Each app runs once with ``FedAvg(...)`` and once with ``LensembleStrategy(...)`` given the
same arguments, on Flower's simulation engine (``run_simulation``), with the same seeds,
partitions and local training; the ServerApp's ``evaluate_fn`` measures the accuracy of
the global model on the whole digits set after every round. It prints the final accuracy
of both and PASS when LensembleStrategy's is at least FedAvg's minus 0.02 (the defaults
differ on purpose: DiLoCo's outer step, uniform weighting; see docs/flower.md). A report,
not a test: the exit code is 0 whatever the outcome.
"""

# ruff: noqa: E402  (Flower reads its environment when it is imported)
from __future__ import annotations

import argparse
import time

from own_flwr_home import use_own_flwr_home

use_own_flwr_home("bench-dropin-flwr-")

from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
)
from flwr.simulation import run_simulation
from sklearn.datasets import load_digits
from torch import nn

from lensemble_flwr.clients import wrap_numpy_client
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.strategies import LensembleStrategy

DIGITS = load_digits()
X_ALL = torch.tensor(DIGITS.images, dtype=torch.float32).unsqueeze(1) / 16
Y_ALL = torch.tensor(DIGITS.target)


class Net(nn.Module):
    def __init__(self, batch_norm: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8) if batch_norm else nn.Identity()
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def shards(count: int, seed: int = 0, alpha: float = 0.5) -> list[np.ndarray]:
    """Non-IID index shards: each class split over the nodes by a Dirichlet draw."""
    rng = np.random.default_rng(seed)
    parts: list[list[int]] = [[] for _ in range(count)]
    for label in range(10):
        idx = rng.permutation(np.flatnonzero(DIGITS.target == label))
        cuts = (np.cumsum(rng.dirichlet([alpha] * count)) * len(idx)).astype(int)[:-1]
        for node, piece in enumerate(np.split(idx, cuts)):
            parts[node].extend(piece.tolist())
    return [np.array(sorted(p), dtype=int) for p in parts]


def partition(context: Context) -> tuple[torch.Tensor, torch.Tensor]:
    node = context.node_config
    part, parts = int(node["partition-id"]), int(node["num-partitions"])
    idx = shards(parts)[part]
    return X_ALL[idx], Y_ALL[idx]


def local_sgd(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float, epochs: int
) -> float:
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(epochs):
        for start in range(0, len(x), 32):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x[start : start + 32]), y[start : start + 32])
            loss.backward()
            optimizer.step()
    return float(loss.detach())


def stock_app(batch_norm: bool, mods: list | None = None) -> ClientApp:
    app = ClientApp(mods=mods or [])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        x, y = partition(context)
        model = Net(batch_norm)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        loss = local_sgd(model, x, y, float(msg.content["config"]["lr"]), epochs=2)
        metrics = MetricRecord({"train_loss": loss, "num-examples": len(x)})
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
        return Message(content=content, reply_to=msg)

    return app


class Client(NumPyClient):
    def __init__(self, context: Context) -> None:
        self.model, (self.x, self.y) = Net(), partition(context)

    def fit(self, parameters: list, config: dict) -> tuple[list, int, dict]:
        keys = list(self.model.state_dict().keys())
        state = OrderedDict({k: torch.tensor(v) for k, v in zip(keys, parameters, strict=True)})
        self.model.load_state_dict(state, strict=True)
        loss = local_sgd(self.model, self.x, self.y, float(config.get("lr", 0.05)), epochs=2)
        return [v.numpy() for v in self.model.state_dict().values()], len(self.x), {"loss": loss}


def numpy_app() -> ClientApp:
    return wrap_numpy_client(
        lambda context: Client(context).to_client(), config_fn=lambda context: LensembleConfig()
    )


def accuracy_of(batch_norm: bool, arrays: ArrayRecord) -> float:
    model = Net(batch_norm)
    model.load_state_dict(arrays.to_torch_state_dict())
    model.eval()
    with torch.no_grad():
        return float((model(X_ALL).argmax(1) == Y_ALL).float().mean())


WRAPPERS = {
    "client": DifferentialPrivacyClientSideFixedClipping,
    "server": DifferentialPrivacyServerSideFixedClipping,
}


def server(kind: str, strategy_args: dict, rounds: int, batch_norm: bool, box: dict,
           wrap: str | None, nodes: int) -> ServerApp:  # fmt: skip
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        if kind == "FedAvg":
            strategy: Any = FedAvg(fraction_evaluate=0.0, **strategy_args)
        else:
            strategy = LensembleStrategy(fraction_evaluate=0.0, **strategy_args)
        if wrap is not None:  # (the grid lists no node yet when the ServerApp starts)
            strategy = WRAPPERS[wrap](
                strategy, noise_multiplier=0.1, clipping_norm=1.0, num_sampled_clients=nodes
            )
        accuracy: dict[int, float] = {}

        def evaluate(rnd: int, arrays: ArrayRecord) -> MetricRecord:
            accuracy[rnd] = accuracy_of(batch_norm, arrays)
            return MetricRecord({"accuracy": accuracy[rnd]})

        started = time.perf_counter()
        try:
            strategy.start(
                grid=grid, initial_arrays=ArrayRecord(Net(batch_norm).state_dict()),
                num_rounds=rounds, train_config=ConfigRecord({"lr": 0.05}),
                evaluate_fn=evaluate,
            )  # fmt: skip
        except Exception as exc:  # reported in the table
            box["error"] = f"{type(exc).__name__}: {exc}"[:120]
        box["accuracy"], box["seconds"] = accuracy, time.perf_counter() - started

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument(
        "--apps",
        default="stock-cnn,stock-cnn-bn,numpyclient,fixedclipping,serverside-dp,fraction-0.3",
    )
    args = parser.parse_args()
    shapes = {
        "stock-cnn": (stock_app(False), False, {}, args.nodes, None),
        "stock-cnn-bn": (stock_app(True), True, {}, args.nodes, None),
        "numpyclient": ((stock_app(False), numpy_app()), False, {}, args.nodes, None),
        "fixedclipping": (stock_app(False, [fixedclipping_mod]), False, {}, args.nodes, "client"),
        "serverside-dp": (stock_app(False), False, {}, args.nodes, "server"),
        "fraction-0.3": (stock_app(False), False, {"fraction_train": 0.3}, 50, None),
    }
    rows = []
    for name in args.apps.split(","):
        client, batch_norm, strategy_args, nodes, wrap = shapes[name]
        result = {}
        apps = client if isinstance(client, tuple) else (client, client)
        for kind, app in zip(("FedAvg", "LensembleStrategy"), apps, strict=True):
            box: dict = {}
            run_simulation(
                server_app=server(kind, strategy_args, args.rounds, batch_norm, box, wrap, nodes),
                client_app=app, num_supernodes=nodes,
                backend_config={"client_resources": {"num_cpus": 1}},
            )  # fmt: skip
            result[kind] = box
        fed, lens = result["FedAvg"], result["LensembleStrategy"]
        done = [args.rounds in r.get("accuracy", {}) for r in (fed, lens)]
        if not all(done):
            why = fed.get("error") or lens.get("error") or "no result"
            rows.append((name, None, None, f"FAIL ({why})"))
            print(f"{name}: FAIL ({why})", flush=True)
            continue
        final_f, final_l = fed["accuracy"][args.rounds], lens["accuracy"][args.rounds]
        verdict = "PASS" if final_l >= final_f - 0.02 else "FAIL"
        rows.append((name, final_f, final_l, verdict, fed["seconds"], lens["seconds"]))
        print(f"{name}: FedAvg {final_f:.3f}, LensembleStrategy {final_l:.3f}: {verdict}",
              flush=True)  # fmt: skip
    print(f"\nfinal accuracy on all of digits after {args.rounds} rounds (Dirichlet 0.5 shards)")
    print(f"{'app':<15} {'FedAvg':>8} {'Lensemble':>10}  verdict   seconds (FedAvg / Lensemble)")
    for row in rows:
        if row[1] is None:
            print(f"{row[0]:<15} {'-':>8} {'-':>10}  {row[3]}")
        else:
            print(f"{row[0]:<15} {row[1]:>8.3f} {row[2]:>10.3f}  {row[3]:<8}  "
                  f"{row[4]:.1f} / {row[5]:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
