"""What the world model's pooled (centralized) baseline shares (``world_tuning``): one
encoder and predictor for every node, each node keeping its own action head."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from lensemble_flwr.simulations.world_model import WorldTrainer


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


