"""The world model's training pieces that its baselines share (``world_tuning``): the
federation's inner AdamW optimizer, built from a run's config with a chosen learning
rate, and the parameters every node shares in a pooled (centralized) model."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.simulations.world_model import WorldTrainer


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


