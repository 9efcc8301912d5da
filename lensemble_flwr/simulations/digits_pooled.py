"""The pooled reference of the digits benchmarks: what the federation's model reaches
when every participant's examples are trained on in one place.

A federated run is judged against it, next to the non-private federation: the
non-private federation can itself stop short of what the model can learn from the same
examples (few rounds, one or two examples per participant), so a ratio to it alone
flatters a private arm. The reference is the same model class, from the same seed,
trained with AdamW on the union of the participants' training examples:

1. a seeded share (``validation_fraction``) of the union, taken in a canonical order so
   that it does not depend on how the examples are split over participants, is held out
   for validation;
2. for every learning rate of the grid, the model trains on the rest for up to
   ``max_epochs`` epochs of shuffled batches and stops ``patience`` epochs after its best
   validation accuracy (ties: the lower validation loss);
3. the learning rate with the best validation score wins. While the winner is an end of
   the grid, the grid is extended past it by ``extend_factor`` (within
   ``[min_lr, max_lr]``), so that the pick is, where it can be, inside the tried grid;
4. the winner's model at its best epoch is scored on the test set.

The reference is trained on the fit split only, a ``1 - validation_fraction`` share of the
examples the federation trains on: it does not get more data than the federation had.
There is no refit on the whole union: with no split left to stop on, nothing would
choose its last epoch.

Everything is a function of its arguments (seeded generators, no global RNG).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from lensemble_flwr.errors import ConfigError
from lensemble_flwr.simulations.digits_data import DigitsPartition

DEFAULT_LRS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)


@dataclasses.dataclass(frozen=True)
class EarlyStopped:
    """One learning rate's run on the fit split: its best epoch (1-based) and the
    validation accuracy and loss there."""

    lr: float
    epochs: int
    validation_accuracy: float
    validation_loss: float

    def score(self) -> tuple[float, float]:
        """Higher is better: the accuracy, then the negated loss (a diverged run last)."""
        loss = self.validation_loss if math.isfinite(self.validation_loss) else math.inf
        return self.validation_accuracy, -loss


@dataclasses.dataclass(frozen=True)
class PooledResult:
    """The pooled reference: the winner's early-stopped model's accuracy on the test set,
    its learning rate and best epoch, the sizes of the fit and validation splits, every
    learning rate's run, and whether the pick lies strictly inside the tried grid (False
    when it is still an end of the grid after extending it to ``min_lr`` or ``max_lr``)."""

    test_accuracy: float
    lr: float
    epochs: int
    fit_examples: int
    validation_examples: int
    grid_interior: bool
    tried: tuple[EarlyStopped, ...]


def pooled_examples(parts: Sequence[DigitsPartition]) -> tuple[np.ndarray, np.ndarray]:
    """The union of the participants' training examples, in a canonical order (by the
    features, column by column, then the label): the same union split another way over
    participants pools the same."""
    if not parts:
        raise ConfigError("parts", "no participant: there is nothing to pool")
    x = np.concatenate([p.x_train for p in parts]).astype(np.float32, copy=False)
    y = np.concatenate([p.y_train for p in parts]).astype(np.int64, copy=False)
    order = np.lexsort(np.column_stack([x, y]).T[::-1])
    return x[order], y[order]


def _scores(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    model.eval()
    with torch.no_grad():
        logits = model(x)
        loss = float(nn.functional.cross_entropy(logits, y))
        accuracy = float((logits.argmax(1) == y).float().mean())
    model.train()
    return accuracy, loss


class _Run:
    """A model of ``model_class`` from ``seed`` and its AdamW, trained an epoch at a time."""

    def __init__(
        self,
        model_class: Callable[..., nn.Module],
        lr: float,
        *,
        weight_decay: float,
        batch_size: int,
        seed: int,
    ) -> None:
        self.model = model_class(seed=seed)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, weight_decay=weight_decay
        )
        self.generator = torch.Generator().manual_seed(seed)
        self.batch_size = batch_size

    def epoch(self, x: torch.Tensor, y: torch.Tensor) -> None:
        order = torch.randperm(len(y), generator=self.generator)
        for start in range(0, len(y), self.batch_size):
            batch = order[start : start + self.batch_size]
            self.optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(self.model(x[batch]), y[batch]).backward()
            self.optimizer.step()


@dataclasses.dataclass(frozen=True)
class _Settings:
    model_class: Callable[..., nn.Module]
    weight_decay: float
    batch_size: int
    max_epochs: int
    patience: int
    seed: int

    def run(self, lr: float) -> _Run:
        return _Run(
            self.model_class, lr, weight_decay=self.weight_decay,
            batch_size=self.batch_size, seed=self.seed,
        )  # fmt: skip


def _early_stopped(
    settings: _Settings, lr: float, fit: tuple[torch.Tensor, ...], val: tuple[torch.Tensor, ...]
) -> tuple[EarlyStopped, nn.Module]:
    """Train at ``lr`` on ``fit`` until ``patience`` epochs pass without a better
    validation score; the best epoch's result and model."""
    run = settings.run(lr)
    best, best_model = EarlyStopped(lr, 0, -math.inf, math.inf), run.model
    for epoch in range(1, settings.max_epochs + 1):
        run.epoch(*fit)
        accuracy, loss = _scores(run.model, *val)
        result = EarlyStopped(lr, epoch, accuracy, loss)
        if best.epochs == 0 or result.score() > best.score():
            best, best_model = result, copy.deepcopy(run.model)
        elif epoch - best.epochs >= settings.patience:
            break
    return best, best_model


def _check(
    lrs: Sequence[float],
    validation_fraction: float,
    settings: _Settings,
    limits: tuple[float, float, float],
) -> None:
    min_lr, max_lr, extend = limits
    if not (math.isfinite(min_lr) and math.isfinite(max_lr) and 0.0 < min_lr <= max_lr):
        raise ConfigError(
            "min_lr", f"need 0 < min_lr <= max_lr, both finite, got {min_lr} and {max_lr}"
        )  # fmt: skip
    if not lrs or any(not (math.isfinite(lr) and lr > 0) for lr in lrs):
        raise ConfigError("lrs", f"need one or more positive learning rates, got {list(lrs)}")
    if not 0.0 < validation_fraction < 1.0:
        raise ConfigError(
            "validation_fraction", f"must be in (0, 1), got {validation_fraction}"
        )  # fmt: skip
    for name in ("batch_size", "max_epochs", "patience"):
        if getattr(settings, name) < 1:
            raise ConfigError(name, f"must be at least 1, got {getattr(settings, name)}")
    if not extend > 1.0:
        raise ConfigError("extend_factor", f"must be above 1, got {extend}")


def _grid_search(
    settings: _Settings,
    lrs: Sequence[float],
    fit: tuple[torch.Tensor, ...],
    val: tuple[torch.Tensor, ...],
    limits: tuple[float, float, float],
) -> tuple[dict[float, tuple[EarlyStopped, nn.Module]], float]:
    """Every learning rate's early-stopped run, the grid extended past an end pick; the
    runs by learning rate and the pick."""
    min_lr, max_lr, factor = limits
    runs = {lr: _early_stopped(settings, lr, fit, val) for lr in sorted(set(lrs))}
    while True:
        grid = sorted(runs)
        pick = max(grid, key=lambda lr: runs[lr][0].score())
        if pick == grid[0] and pick / factor >= min_lr:
            lr = pick / factor
        elif pick == grid[-1] and pick * factor <= max_lr:
            lr = pick * factor
        else:
            break
        runs[lr] = _early_stopped(settings, lr, fit, val)
    return runs, pick


def pooled_reference(
    parts: Sequence[DigitsPartition],
    x_test: np.ndarray,
    y_test: np.ndarray,
    *,
    model_class: Callable[..., nn.Module],
    lrs: Sequence[float] = DEFAULT_LRS,
    validation_fraction: float = 0.15,
    batch_size: int = 32,
    max_epochs: int = 300,
    patience: int = 30,
    weight_decay: float = 0.1,
    extend_factor: float = 3.0,
    min_lr: float = 1e-5,
    max_lr: float = 10.0,
    seed: int = 0,
) -> PooledResult:
    """``model_class`` trained in one place on the union of ``parts``' training examples,
    tuned and early-stopped on a held-out share of them, scored on ``(x_test, y_test)``
    (see the module docstring for the procedure).

    Raises:
        ConfigError: no participant, an empty test set, a union too small to hold out a
            validation split and keep a fit split, or a setting out of range (``lrs``
            empty or not positive, ``validation_fraction`` outside (0, 1), ``batch_size``,
            ``max_epochs`` or ``patience`` below 1, ``extend_factor`` not above 1,
            ``min_lr`` not positive or above ``max_lr``: the grid could then grow forever).
    """
    settings = _Settings(model_class, weight_decay, batch_size, max_epochs, patience, seed)
    _check(lrs, validation_fraction, settings, (min_lr, max_lr, extend_factor))
    x, y = pooled_examples(parts)
    if len(y_test) == 0:
        raise ConfigError("y_test", "the test set is empty")
    held = math.ceil(validation_fraction * len(y))
    if held >= len(y):
        raise ConfigError(
            "parts", f"{len(y)} pooled examples cannot keep a fit split next to a "
            f"validation split of {held}",
        )  # fmt: skip
    order = np.random.default_rng(seed).permutation(len(y))
    tensors = torch.from_numpy(x), torch.from_numpy(y)
    val = tuple(t[torch.from_numpy(order[:held])] for t in tensors)
    fit = tuple(t[torch.from_numpy(order[held:])] for t in tensors)
    runs, pick = _grid_search(settings, lrs, fit, val, (min_lr, max_lr, extend_factor))
    best, model = runs[pick]
    test = torch.from_numpy(np.asarray(x_test, np.float32)), torch.from_numpy(
        np.asarray(y_test, np.int64)
    )
    grid = sorted(runs)
    return PooledResult(
        test_accuracy=_scores(model, *test)[0],
        lr=pick,
        epochs=best.epochs,
        fit_examples=len(y) - held,
        validation_examples=held,
        grid_interior=grid[0] < pick < grid[-1],
        tried=tuple(runs[lr][0] for lr in grid),
    )
