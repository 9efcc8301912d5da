"""Baselines tuned on held-out data: what a node gets alone at its best, and what pooling
everyone's data gets, each measured on validation data that chose nothing.

A node's validation trajectories are split in two halves (:func:`split_validation`): the
*tuning* half chooses a baseline's learning rate and its stopping step; the *scoring*
half measures the chosen model. The federated model is measured on the same scoring
half, so all three arms are compared on data none of them was tuned on.

* **tuned local-only** (:func:`tuned_local_only`): for each learning rate of a grid, the
  node trains alone, is evaluated on both halves every ``every`` steps, and stops once its
  tuning loss has not improved for ``patience`` evaluations (:func:`train_until_stale`);
  the evaluation with the lowest tuning loss is the run's stopping step. The learning rate
  whose stopping step has the lowest tuning loss wins, and the grid grows past an edge
  pick (:func:`search_lr`), so the pick is a minimum of the grid, not its end.
* **tuned centralized** (:func:`tuned_centralized`): the same search for one encoder and
  predictor with a head per node on batches from every node, judged on the mean over
  nodes of their tuning losses.

Everything here is a pure function of its arguments (seeded, deterministic algorithms).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from lensemble_flwr.canonical import derive_seed
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.participant.local_training import deterministic_algorithms, inner_adamw
from lensemble_flwr.simulations.world_baselines import share_encoder_and_predictor
from lensemble_flwr.simulations.world_data import ParticipantData, Transitions
from lensemble_flwr.simulations.world_model import WorldTrainer

LR_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)
"""The default grid: these multiples of the federation's ``inner-lr``."""


@dataclasses.dataclass(frozen=True)
class Stopping:
    """When a baseline's run is evaluated and when it stops: every ``every`` steps, until
    ``patience`` evaluations in a row have not lowered the tuning loss, or at
    ``max_steps``.

    Raises:
        ConfigError: a count below 1, or ``max_steps`` < ``every``.
    """

    every: int = 20
    patience: int = 10
    max_steps: int = 4000

    def __post_init__(self) -> None:
        for name in ("every", "patience", "max_steps"):
            if getattr(self, name) < 1:
                raise ConfigError("stopping", f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps < self.every:
            raise ConfigError("stopping", f"max_steps {self.max_steps} < every {self.every}")


DEFAULT_STOPPING = Stopping()
"""Every 20 steps, patience 10 evaluations (200 steps), at most 4000 steps."""


def _key(loss: float) -> float:
    return loss if math.isfinite(loss) else math.inf


@dataclasses.dataclass(frozen=True)
class Trial:
    """One run at one learning rate: at each evaluated step (0 first), the tuning loss
    and the scoring loss of each node (one node for local-only)."""

    lr: float
    steps: tuple[int, ...]
    tune: tuple[float, ...]
    score: tuple[tuple[float, ...], ...]  # [evaluation][node]
    capped: bool  # stopped at max_steps while the tuning loss could still improve

    @property
    def best(self) -> int:
        """The index of the evaluation with the lowest tuning loss (the first such)."""
        return min(range(len(self.tune)), key=lambda i: _key(self.tune[i]))

    @property
    def best_step(self) -> int:
        """The stopping step the tuning half chose."""
        return self.steps[self.best]

    @property
    def best_tune(self) -> float:
        """The tuning loss at the stopping step."""
        return self.tune[self.best]

    @property
    def best_score(self) -> tuple[float, ...]:
        """Each node's scoring loss at the stopping step."""
        return self.score[self.best]


@dataclasses.dataclass(frozen=True)
class LrSearch:
    """Every learning rate tried (ascending) and the chosen one's trial; ``at_edge``: the
    pick is still the grid's smallest or largest after the allowed extensions."""

    trials: tuple[Trial, ...]
    chosen: Trial
    at_edge: bool


def split_validation(validation: Transitions, trajectories: int) -> tuple[Transitions, Transitions]:
    """The tuning half (the first ``trajectories // 2`` trajectories) and the scoring
    half (the rest) of a validation set of ``trajectories`` equal rollouts, stored one
    trajectory after another (:func:`world_data.rollout`). Whole trajectories, so the
    halves share no rollout.

    Raises:
        ConfigError: fewer than 2 trajectories, or a set that does not split into
            ``trajectories`` equal rollouts.
    """
    if trajectories < 2:
        raise ConfigError("validation-trajectories", f"a split needs >= 2, got {trajectories}")
    if len(validation) % trajectories:
        raise ConfigError(
            "validation-trajectories",
            f"{len(validation)} transitions are not {trajectories} equal trajectories",
        )
    cut = (trajectories // 2) * (len(validation) // trajectories)

    def rows(part: slice) -> Transitions:
        return Transitions(
            obs=validation.obs[part],
            actions=validation.actions[part],
            next_obs=validation.next_obs[part],
        )

    return rows(slice(0, cut)), rows(slice(cut, None))


def train_until_stale(
    step: Callable[[], None],
    measure: Callable[[], tuple[float, tuple[float, ...]]],
    *,
    lr: float,
    stopping: Stopping,
) -> Trial:
    """Call ``step`` (one optimizer step) and, at step 0 and every ``stopping.every``
    steps, ``measure`` (the tuning loss and the nodes' scoring losses), until the tuning
    loss has not improved for ``stopping.patience`` evaluations or ``stopping.max_steps``
    steps are done. A non-finite tuning loss counts as no improvement."""
    steps, tune, score = [0], [], []
    t, s = measure()
    tune.append(t)
    score.append(s)
    best, stale, done = _key(t), 0, 0
    while done < stopping.max_steps and stale < stopping.patience:
        chunk = min(stopping.every, stopping.max_steps - done)
        for _ in range(chunk):
            step()
        done += chunk
        t, s = measure()
        steps.append(done)
        tune.append(t)
        score.append(s)
        if _key(t) < best:
            best, stale = _key(t), 0
        else:
            stale += 1
    return Trial(lr, tuple(steps), tuple(tune), tuple(score), capped=stale < stopping.patience)


def search_lr(
    trial: Callable[[float], Trial],
    grid: Sequence[float],
    *,
    factor: float = 2.0,
    max_extensions: int = 4,
) -> LrSearch:
    """Run ``trial`` at every learning rate of ``grid``; while the lowest tuning loss is
    at the grid's smallest (largest) rate, try that rate divided (multiplied) by
    ``factor``, at most ``max_extensions`` times (a grid of one rate is not searched).
    The chosen trial has the lowest tuning loss at its stopping step.

    Raises:
        ConfigError: an empty grid, a rate that is not finite and > 0, a repeated rate,
            ``factor`` <= 1 or ``max_extensions`` < 0.
    """
    rates = [float(lr) for lr in grid]
    if not rates or any(not (math.isfinite(lr) and lr > 0) for lr in rates):
        raise ConfigError("lr grid", f"needs finite rates > 0, got {list(grid)}")
    if len(set(rates)) != len(rates):
        raise ConfigError("lr grid", f"repeats a rate: {rates}")
    if not (math.isfinite(factor) and factor > 1) or max_extensions < 0:
        raise ConfigError(
            "lr grid", f"factor must be > 1 and max_extensions >= 0, got {factor}, {max_extensions}"
        )
    trials = {lr: trial(lr) for lr in rates}
    if len(rates) == 1:  # one rate: a fixed rate, no search
        max_extensions = 0

    def chosen() -> Trial:
        return min(trials.values(), key=lambda t: (_key(t.best_tune), t.lr))

    for _ in range(max_extensions):
        pick = chosen().lr
        if pick == min(trials):
            lr = pick / factor
        elif pick == max(trials):
            lr = pick * factor
        else:
            break
        trials[lr] = trial(lr)
    pick = chosen()
    at_edge = len(trials) > 1 and pick.lr in (min(trials), max(trials))
    return LrSearch(tuple(trials[lr] for lr in sorted(trials)), pick, at_edge)


def lr_grid(config: LensembleConfig) -> tuple[float, ...]:
    """The default grid: :data:`LR_FACTORS` times the config's ``inner-lr``."""
    return tuple(config.inner.lr * f for f in LR_FACTORS)


def tuned_local_only(
    data: ParticipantData,
    validation_trajectories: int,
    config: LensembleConfig,
    *,
    init_seed: int = 0,
    grid: Sequence[float] | None = None,
    stopping: Stopping = DEFAULT_STOPPING,
) -> LrSearch:
    """One node alone (its whole model from the federation's initial one), its learning
    rate and stopping step chosen on its tuning half, scored on its scoring half; the
    federation's inner optimizer and batch size otherwise.

    Raises:
        ConfigError: see :func:`split_validation` and :func:`search_lr`.
    """
    tune_set, score_set = split_validation(data.validation, validation_trajectories)
    inner = config.inner

    def trial(lr: float) -> Trial:
        trainer = WorldTrainer(data, init_seed=init_seed)
        optimizer = inner_adamw(trainer.model.parameters(), config, lr=lr)
        seed = derive_seed(init_seed, "local-only", data.embodiment.index)
        generator = torch.Generator().manual_seed(seed)
        trainer.model.train()

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            trainer.loss(
                trainer.model, trainer.sample_batch(generator, inner.batch_size)
            ).backward()
            optimizer.step()

        def measure() -> tuple[float, tuple[float, ...]]:
            return trainer.loss_on(tune_set), (trainer.loss_on(score_set),)

        with deterministic_algorithms(inner.deterministic):
            return train_until_stale(step, measure, lr=lr, stopping=stopping)

    return search_lr(trial, lr_grid(config) if grid is None else grid)


def tuned_centralized(
    datas: Sequence[ParticipantData],
    validation_trajectories: int,
    config: LensembleConfig,
    *,
    init_seed: int = 0,
    grid: Sequence[float] | None = None,
    stopping: Stopping = DEFAULT_STOPPING,
) -> LrSearch:
    """One encoder and predictor, a head per node, each step on the mean loss over nodes
    of an ``inner-batch-size`` batch from each; learning rate and stopping step chosen
    on the mean over nodes of their tuning losses, each node scored on its scoring half.

    Raises:
        ConfigError: no node; see :func:`split_validation` and :func:`search_lr`.
    """
    if not datas:
        raise ConfigError("num-partitions", "a baseline needs at least one node")
    halves = [split_validation(d.validation, validation_trajectories) for d in datas]
    inner = config.inner

    def trial(lr: float) -> Trial:
        trainers = [WorldTrainer(d, init_seed=init_seed) for d in datas]
        optimizer = inner_adamw(share_encoder_and_predictor(trainers), config, lr=lr)
        generator = torch.Generator().manual_seed(derive_seed(init_seed, "centralized"))
        for trainer in trainers:
            trainer.model.train()

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            batches = (
                t.loss(t.model, t.sample_batch(generator, inner.batch_size)) for t in trainers
            )
            (sum(batches) / len(trainers)).backward()
            optimizer.step()

        def measure() -> tuple[float, tuple[float, ...]]:
            tune = [t.loss_on(h[0]) for t, h in zip(trainers, halves, strict=True)]
            score = tuple(t.loss_on(h[1]) for t, h in zip(trainers, halves, strict=True))
            return sum(tune) / len(tune), score

        with deterministic_algorithms(inner.deterministic):
            return train_until_stale(step, measure, lr=lr, stopping=stopping)

    return search_lr(trial, lr_grid(config) if grid is None else grid)
