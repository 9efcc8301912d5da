"""What federating the world model is measured against: each node alone, and everyone's
data in one place.

* **local-only**: a node trains its own world model (encoder, predictor and action head)
  on its own data with the federation's inner optimizer, for the same number of AdamW
  steps the federation gives it (``rounds × inner-steps``), never exchanging anything.
  This is what a node gets if it does not join, so it is the bar a federation must clear
  for the node to want to join.
* **centralized**: one encoder and predictor shared by everyone and one action head per
  node, trained on batches drawn from every node's data (``inner-batch-size`` rows from
  each node per step) for the same number of steps. It is what the federation
  approximates without moving data.

Both start from the federation's initial model (the same shared groups, each node's own
head seed) and report, after every ``inner-steps`` steps, each node's validation loss
(with its own head) and its loss on its own training data. Both are pure functions of
their arguments (seeded, deterministic algorithms).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch

from lensemble_flwr.canonical import derive_seed
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.participant.local_training import deterministic_algorithms
from lensemble_flwr.simulations.world_data import ParticipantData
from lensemble_flwr.simulations.world_model import WorldTrainer


@dataclasses.dataclass(frozen=True)
class Curves:
    """Per node, per round (index 0: the initial model), the validation loss and the loss
    on the node's own training data."""

    validation: list[list[float]]  # [node][round]
    train: list[list[float]]  # [node][round]


def adamw(
    params: Sequence[torch.nn.Parameter], config: LensembleConfig, *, lr: float | None = None
) -> torch.optim.AdamW:
    """The federation's inner optimizer over ``params`` (AdamW with the config's betas,
    eps and weight decay), at ``lr`` (default: the config's ``inner-lr``)."""
    inner = config.inner
    return torch.optim.AdamW(
        params,
        lr=inner.lr if lr is None else lr,
        betas=(inner.beta1, inner.beta2),
        eps=inner.eps,
        weight_decay=inner.weight_decay,
    )


def _check(rounds: int, datas: Sequence[ParticipantData]) -> None:
    if rounds < 0:
        raise ConfigError("num-server-rounds", f"must be >= 0, got {rounds}")
    if not datas:
        raise ConfigError("num-partitions", "a baseline needs at least one node")


def _record(trainers: Sequence[WorldTrainer], curves: Curves) -> None:
    for i, trainer in enumerate(trainers):
        curves.validation[i].append(trainer.validation_loss())
        curves.train[i].append(trainer.train_loss())


def local_only(
    datas: Sequence[ParticipantData],
    config: LensembleConfig,
    *,
    rounds: int,
    init_seed: int = 0,
) -> Curves:
    """Every node alone: ``rounds × inner-steps`` AdamW steps on its own data (one
    optimizer for the whole run, as a node that never joins would train).

    Raises:
        ConfigError: ``rounds`` < 0 or no node.
    """
    _check(rounds, datas)
    curves = Curves([[] for _ in datas], [[] for _ in datas])
    trainers = [WorldTrainer(d, init_seed=init_seed) for d in datas]
    _record(trainers, curves)
    inner = config.inner
    with deterministic_algorithms(inner.deterministic):
        for i, trainer in enumerate(trainers):
            optimizer = adamw(list(trainer.model.parameters()), config)
            index = trainer.data.embodiment.index
            generator = torch.Generator().manual_seed(derive_seed(init_seed, "local-only", index))
            trainer.model.train()
            for _ in range(rounds):
                for _ in range(inner.steps):
                    optimizer.zero_grad(set_to_none=True)
                    loss = trainer.loss(
                        trainer.model, trainer.sample_batch(generator, inner.batch_size)
                    )
                    loss.backward()
                    optimizer.step()
                curves.validation[i].append(trainer.validation_loss())
                curves.train[i].append(trainer.train_loss())
    return curves


def share_encoder_and_predictor(trainers: Sequence[WorldTrainer]) -> list[torch.nn.Parameter]:
    """Make every trainer use the first one's encoder and predictor (each keeps its own
    action head); returns the parameters to train: the shared ones, then every head's."""
    shared = trainers[0].model
    for trainer in trainers[1:]:
        trainer.model.encoder = shared.encoder
        trainer.model.predictor = shared.predictor
    params = list(shared.encoder.parameters()) + list(shared.predictor.parameters())
    heads = (t.model.action_head.parameters() for t in trainers)
    return params + list(itertools.chain.from_iterable(heads))


def centralized(
    datas: Sequence[ParticipantData],
    config: LensembleConfig,
    *,
    rounds: int,
    init_seed: int = 0,
) -> Curves:
    """One shared encoder and predictor, a head per node, ``rounds × inner-steps`` AdamW
    steps, each on the mean loss over nodes of an ``inner-batch-size`` batch from each.

    Raises:
        ConfigError: ``rounds`` < 0 or no node.
    """
    _check(rounds, datas)
    curves = Curves([[] for _ in datas], [[] for _ in datas])
    trainers = [WorldTrainer(d, init_seed=init_seed) for d in datas]
    optimizer = adamw(share_encoder_and_predictor(trainers), config)
    generator = torch.Generator().manual_seed(derive_seed(init_seed, "centralized"))
    _record(trainers, curves)
    inner = config.inner
    with deterministic_algorithms(inner.deterministic):
        for trainer in trainers:
            trainer.model.train()
        for _ in range(rounds):
            for _ in range(inner.steps):
                optimizer.zero_grad(set_to_none=True)
                loss = sum(
                    t.loss(t.model, t.sample_batch(generator, inner.batch_size)) for t in trainers
                )
                (loss / len(trainers)).backward()
                optimizer.step()
            _record(trainers, curves)
    return curves
