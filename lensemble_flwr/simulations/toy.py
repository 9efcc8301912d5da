"""A small, CPU-fast federated task for the in-process federation, tests and benchmarks.

Every participant learns the same teacher map y = W x from its own corner of the input
space (the task is shared; only where inputs come from differs). The model has an
``encoder`` and a ``predictor`` (shared) and an ``action_head`` (local: it reads the
participant's own action channel, which the teacher ignores).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from lensemble_flwr.config import ParamGroupsConfig

D_IN, D_LATENT, D_OUT, D_ACTION = 8, 6, 3, 2


GROUPS = ParamGroupsConfig(shared=("encoder", "predictor"), local=("action_head",))
"""The toy model's groups, for a config that names them (the default, ``'*'`` shared, works
too: :func:`initial_params` leaves the action head out, so it is never broadcast)."""


class ToyWorldModel(nn.Module):
    """encoder: x → z; action_head: a → z offset (local); predictor: z → y."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.encoder = nn.Linear(D_IN, D_LATENT)
        self.predictor = nn.Linear(D_LATENT, D_OUT)
        self.action_head = nn.Linear(D_ACTION, D_LATENT, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return self.predictor(torch.tanh(self.encoder(x) + self.action_head(a)))


def teacher(seed: int = 1234) -> np.ndarray:
    """The shared target map, (D_OUT, D_IN)."""
    return np.random.default_rng(seed).standard_normal((D_OUT, D_IN)).astype(np.float32) * 0.5


class ToyTrainer:
    """One participant's private data and loss (implements the Participant's Trainer).

    Args:
        index: which corner of the input space this participant samples from.
        num_examples: size of its private dataset.
        seed: data seed (the data is a pure function of ``index`` and ``seed``).
    """

    def __init__(self, index: int, *, num_examples: int = 64, seed: int = 0) -> None:
        rng = np.random.default_rng([seed, index])
        corner = np.where(np.arange(D_IN) % 4 == index % 4, 1.5, -0.5).astype(np.float32)
        self.x = (rng.standard_normal((num_examples, D_IN)) * 0.7 + corner).astype(np.float32)
        self.a = rng.standard_normal((num_examples, D_ACTION)).astype(np.float32)
        self.y = np.tanh(self.x @ teacher().T).astype(np.float32)
        self.model = ToyWorldModel(seed=0)
        self._x, self._a, self._y = map(torch.from_numpy, (self.x, self.a, self.y))

    def num_examples(self) -> int:
        """The size of the private dataset."""
        return len(self.x)

    def dataset_records(self) -> Iterator[bytes]:
        """Each example as the float32 bytes of its input, action and target."""
        for i in range(len(self.x)):
            yield self.x[i].tobytes() + self.a[i].tobytes() + self.y[i].tobytes()

    def sample_batch(self, generator: torch.Generator, batch_size: int) -> Any:
        """``(x, a, y)`` of ``batch_size`` examples drawn with replacement."""
        idx = torch.randint(len(self.x), (batch_size,), generator=generator)
        return self._x[idx], self._a[idx], self._y[idx]

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Mean squared error of ``model(x, a)`` against ``y``."""
        x, a, y = batch
        return nn.functional.mse_loss(model(x, a), y)


def initial_params(seed: int = 0) -> dict[str, np.ndarray]:
    """θ_0: the shared groups of a freshly initialised model."""
    model = ToyWorldModel(seed=seed)
    return {
        n: t.detach().numpy().copy()
        for n, t in sorted(model.state_dict().items())
        if not n.startswith("action_head")
    }


def global_loss(params: dict[str, np.ndarray], trainers: list[ToyTrainer]) -> float:
    """Loss of the shared model on the union of the participants' data (zero actions)."""
    model = ToyWorldModel()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name in params:
                tensor.copy_(torch.from_numpy(np.array(params[name])))
        model.action_head.weight.zero_()
        x = torch.from_numpy(np.concatenate([t.x for t in trainers]))
        y = torch.from_numpy(np.concatenate([t.y for t in trainers]))
        return float(nn.functional.mse_loss(model(x, torch.zeros(len(x), D_ACTION)), y))
