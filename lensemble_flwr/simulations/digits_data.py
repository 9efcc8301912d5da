"""The digits example app's task (apps/digits): scikit-learn's digits, split non-IID.

The 1797 8x8 digit images ship inside scikit-learn, so the demo runs offline. They are
split across participants by a Dirichlet label skew (each participant sees mostly a few
digits), which is the setting where federated averaging is actually tested; a uniform
split would make every participant a copy of the others. Everything here is a pure
function of its arguments, so a SuperNode that lives for a single message rebuilds
exactly the same private dataset (and so the same Merkle commitment) every time.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from lensemble_flwr.config import ParamGroupsConfig
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.params import load_shared

D_IN, D_HIDDEN, NUM_CLASSES = 64, 32, 10
MIN_TRAIN_EXAMPLES = 10
_RESAMPLE_ATTEMPTS = 100
_ALL_SHARED = ParamGroupsConfig(shared=("*",), local=())


@functools.lru_cache(maxsize=1)
def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """All 1797 examples: features in [0, 1] as float32 (N, 64), labels int64 (N,).

    Cached and read-only: every participant in a process shares one copy.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError(
            "the digits example reads scikit-learn's bundled digits; scikit-learn is an "
            "optional dependency: pip install 'lensemble-flwr[examples]'"
        ) from exc

    data = load_digits()
    x = (np.asarray(data.data, dtype=np.float32) / np.float32(16.0)).astype("<f4")
    y = np.asarray(data.target, dtype="<i8")
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y


def _dirichlet_draw(
    labels: np.ndarray, num_partitions: int, alpha: float, rng: np.random.Generator
) -> list[list[int]]:
    """Per class, split its shuffled indices among partitions by Dirichlet(alpha)."""
    parts: list[list[int]] = [[] for _ in range(num_partitions)]
    for cls in range(NUM_CLASSES):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        proportions = rng.dirichlet(np.full(num_partitions, alpha))
        cuts = (np.cumsum(proportions)[:-1] * len(idx)).astype(int)
        for part, chunk in zip(parts, np.split(idx, cuts), strict=True):
            part.extend(chunk.tolist())
    return parts


def _repair(parts: list[list[int]], min_size: int) -> None:
    """Move examples from the largest partition to each one below ``min_size``.

    Deterministic (ties go to the lowest partition id); only reached when resampling
    keeps failing, e.g. many partitions with a small alpha.
    """
    for part in parts:
        while len(part) < min_size:
            donor = max(parts, key=len)
            part.append(donor.pop())


@functools.lru_cache(maxsize=16)
def _partition_indices(
    num_partitions: int, seed: int, alpha: float, min_size: int
) -> tuple[np.ndarray, ...]:
    """Disjoint index sets covering the dataset, each of at least ``min_size``."""
    _, labels = _load_digits()
    if num_partitions * min_size > len(labels):
        raise ValueError(
            f"{num_partitions} partitions of at least {min_size} examples do not fit in "
            f"{len(labels)} examples"
        )
    rng = np.random.default_rng(seed)
    for _ in range(_RESAMPLE_ATTEMPTS):
        parts = _dirichlet_draw(labels, num_partitions, alpha, rng)
        if min(map(len, parts)) >= min_size:
            break
    else:
        _repair(parts, min_size)
    out = tuple(np.sort(np.asarray(p, dtype=np.int64)) for p in parts)
    for arr in out:
        arr.setflags(write=False)
    return out


@dataclasses.dataclass(frozen=True)
class DigitsPartition:
    """One participant's private train split and local test split."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    partition_id: int


def load_partition(
    partition_id: int,
    num_partitions: int,
    *,
    seed: int = 0,
    alpha: float = 0.5,
    test_fraction: float = 0.2,
) -> DigitsPartition:
    """Partition ``partition_id`` of a Dirichlet(alpha) label-skew split of digits.

    Smaller ``alpha`` means more skew. The partitions are disjoint and cover all 1797
    examples; each has at least :data:`MIN_TRAIN_EXAMPLES` training examples. The local
    test split is a seeded shuffle of the partition, and both splits are kept in dataset
    order so that :meth:`DigitsTrainer.dataset_records` has a canonical order.
    """
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition_id {partition_id} not in [0, {num_partitions})")
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    if alpha <= 0:
        raise ValueError(f"alpha must be positive, got {alpha}")
    # floor(n * test_fraction) test examples leave >= MIN_TRAIN_EXAMPLES for training.
    min_size = math.ceil(MIN_TRAIN_EXAMPLES / (1.0 - test_fraction))
    indices = _partition_indices(num_partitions, seed, float(alpha), min_size)[partition_id]
    n_test = math.floor(len(indices) * test_fraction)
    shuffled = np.random.default_rng([seed, partition_id]).permutation(indices)
    test_idx, train_idx = np.sort(shuffled[:n_test]), np.sort(shuffled[n_test:])
    x, y = _load_digits()
    return DigitsPartition(
        x_train=x[train_idx],
        y_train=y[train_idx],
        x_test=x[test_idx],
        y_test=y[test_idx],
        partition_id=partition_id,
    )


def _seeded_init(layers: tuple[nn.Linear, ...], seed: int) -> None:
    """torch's default Linear init, but from our own generator rather than the global
    one, so that the initial model is a function of ``seed`` alone."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in layers:
            bound = 1.0 / math.sqrt(layer.in_features)
            for p in (layer.weight, layer.bias):
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)


class DigitsNet(nn.Module):
    """encoder: 64 pixels → 32 features; predictor: features → 10 logits."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.ReLU())
        self.predictor = nn.Linear(D_HIDDEN, NUM_CLASSES)
        _seeded_init((self.encoder[0], self.predictor), seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.predictor(self.encoder(x))


class DigitsLinear(nn.Module):
    """predictor: 64 pixels → 10 logits (softmax regression, 650 parameters).

    The model for differential privacy at this data size: the L2 norm of the noise a
    private sum carries grows with the square root of the number of parameters, and with
    a handful of examples per participant the hidden layer of :class:`DigitsNet` buys no
    accuracy.
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.predictor = nn.Linear(D_IN, NUM_CLASSES)
        _seeded_init((self.predictor,), seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.predictor(x)


class DigitsTrainer:
    """One participant's digits partition and classifier (implements the Trainer).

    Args:
        partition: the participant's private data.
        init_seed: seed of the initial model; the same for every participant, so they
            all start identical before the first global state arrives.
        model_class: what builds the classifier from a seed (:class:`DigitsNet`, the
            default, or :class:`DigitsLinear`).
    """

    def __init__(
        self,
        partition: DigitsPartition,
        *,
        init_seed: int = 0,
        model_class: Callable[..., nn.Module] = DigitsNet,
    ) -> None:
        self.partition = partition
        self.init_seed = init_seed
        self.model_class = model_class
        self.model = model_class(seed=init_seed)
        self._x, self._y = torch.from_numpy(partition.x_train), torch.from_numpy(partition.y_train)

    def num_examples(self) -> int:
        """The size of the training split."""
        return len(self.partition.y_train)

    def dataset_records(self) -> Iterator[bytes]:
        """Each training example as its float32 features then its int64 label, little
        endian, in partition order."""
        x = np.ascontiguousarray(self.partition.x_train, dtype="<f4")
        y = np.ascontiguousarray(self.partition.y_train, dtype="<i8")
        for i in range(len(y)):
            yield x[i].tobytes() + y[i].tobytes()

    def sample_batch(self, generator: torch.Generator, batch_size: int) -> Any:
        """``(x, y)`` of ``batch_size`` training examples drawn with replacement."""
        idx = torch.randint(len(self._y), (batch_size,), generator=generator)
        return self._x[idx], self._y[idx]

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Cross-entropy of ``model`` on the batch."""
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    def evaluate(self, params: Mapping[str, np.ndarray] | None = None) -> tuple[float, float, int]:
        """(loss, accuracy, number of examples) on the local test split.

        With ``params``, a copy of the model with those params is evaluated and
        ``self.model`` is left alone. An empty test split gives (0.0, 0.0, 0): zero
        weight in any weighted average, where a NaN would poison it.
        """
        model = copy.deepcopy(self.model)
        if params is not None:
            load_shared(model, params, _ALL_SHARED)
        return self.evaluate_model(model)

    def evaluate_model(self, model: nn.Module) -> tuple[float, float, int]:
        """(loss, accuracy, number of examples) of ``model`` itself (e.g. the node's
        local-only model) on the local test split; as :meth:`evaluate` for an empty one."""
        loss, acc = _evaluate(model, self.partition.x_test, self.partition.y_test)
        return loss, acc, len(self.partition.y_test)


def _evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    if len(y) == 0:
        return 0.0, 0.0
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
        target = torch.from_numpy(y)
        loss = nn.functional.cross_entropy(logits, target)
        acc = (logits.argmax(dim=1) == target).float().mean()
    return float(loss), float(acc)


def initial_params(
    seed: int = 0, *, model_class: Callable[..., nn.Module] = DigitsNet
) -> dict[str, np.ndarray]:
    """θ_0: every tensor of a freshly initialised ``model_class`` (default: DigitsNet), in
    sorted order."""
    net = model_class(seed=seed)
    return {
        n: t.detach().numpy().astype(np.float32, copy=True)
        for n, t in sorted(net.state_dict().items())
    }


def centralized_evaluate(
    params: Mapping[str, np.ndarray],
    *,
    seed: int = 0,
    num_partitions: int = 10,
    alpha: float = 0.5,
    test_fraction: float = 0.2,
    model_class: Callable[..., nn.Module] = DigitsNet,
) -> tuple[float, float]:
    """(loss, accuracy) of ``params``, a ``model_class``'s, on the union of all
    partitions' test splits.

    For reporting only: no participant holds this union. The partitioning arguments
    must match the participants' for it to be their held-out data.
    """
    parts = [
        load_partition(i, num_partitions, seed=seed, alpha=alpha, test_fraction=test_fraction)
        for i in range(num_partitions)
    ]
    model = model_class()
    load_shared(model, params, _ALL_SHARED)
    x = np.concatenate([p.x_test for p in parts])
    y = np.concatenate([p.y_test for p in parts])
    return _evaluate(model, x, y)


MODELS: dict[str, Callable[..., nn.Module]] = {"net": DigitsNet, "linear": DigitsLinear}
"""The digits app's ``model`` key: ``"net"`` (:class:`DigitsNet`, 2,410 parameters) or
``"linear"`` (:class:`DigitsLinear`, 650)."""


def model_class_of(name: object) -> Callable[..., nn.Module]:
    """The classifier the digits app's ``model`` key names.

    Raises:
        ConfigError: ``name`` is not one of :data:`MODELS`.
    """
    if not isinstance(name, str) or name not in MODELS:
        raise ConfigError("model", f"{name!r} is not a digits model; use one of {sorted(MODELS)}")
    return MODELS[name]
