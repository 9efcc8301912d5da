"""The ClientApp of ``benchmarks/bench_deployment.py``: Flower's quickstart shape on digits.

A stock Message-API ClientApp, the same for both strategies (it imports nothing of
lensemble): ``train`` loads ``arrays.to_torch_state_dict()``, runs two epochs of SGD on its
shard of scikit-learn's digits (``partition-id`` of ``num-partitions``, Dirichlet 0.5 over
the classes, as ``benchmarks/bench_dropin.py``), and replies ``arrays`` +
``metrics{train_loss, num-examples}``. The model is bench_dropin's ``stock-cnn``:
Conv2d(1, 8, 3) and Linear(512, 10), 5,210 parameters.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from sklearn.datasets import load_digits
from torch import nn

DIGITS = load_digits()
X_ALL = torch.tensor(DIGITS.images, dtype=torch.float32).unsqueeze(1) / 16
Y_ALL = torch.tensor(DIGITS.target)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


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


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    node = context.node_config
    idx = shards(int(node["num-partitions"]))[int(node["partition-id"])]
    x, y = X_ALL[idx], Y_ALL[idx]
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=float(msg.content["config"]["lr"]),
                                momentum=0.9)  # fmt: skip
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(2):
        for start in range(0, len(x), 32):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x[start : start + 32]), y[start : start + 32])
            loss.backward()
            optimizer.step()
    metrics = MetricRecord({"train_loss": float(loss.detach()), "num-examples": len(x)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


