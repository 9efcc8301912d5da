"""A node of the byte language model app (apps/lm): its trainer, and its local-only twin.

:class:`LmTrainer` is the node's :class:`~lensemble_flwr.participant.local_training.Trainer`:
its source files (:mod:`lm_data`) and a :class:`~lm_model.ByteLM`, on :func:`lm_device`.
:class:`LmTraining` is the usual AdamW inner loop over it, plus what the app measures the
federation against: a second model of the node's own that starts from the same initial
weights and, every time the node trains for the federation, takes as many AdamW steps on
the same batches, but never leaves the node and never takes the global model. Its weights
and inner optimizer ride in the node's saved state (``local-only/...`` arrays), so that a
node rebuilt for an evaluate message still has it (:mod:`~lensemble_flwr.simulations.local_only`,
which the digits app shares).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from lensemble_flwr.config import LensembleConfig, ParamGroupsConfig
from lensemble_flwr.params import load_broadcast
from lensemble_flwr.simulations.lm_data import (
    NodeCorpus,
    as_bytes,
    evaluation_windows,
    training_windows,
)
from lensemble_flwr.simulations.lm_model import (
    ByteLM,
    ModelShape,
    evaluate_bits_per_byte,
    lm_device,
    next_byte_loss,
)
from lensemble_flwr.simulations.local_only import LocalOnlyTraining

ALL_SHARED = ParamGroupsConfig(shared=("*",), local=())


class LmTrainer:
    """One node's source files and byte model (implements the Trainer).

    Args:
        corpus: the node's training and validation files.
        shape: the model's size (every node's must be the same).
        init_seed: the initial model's seed, the same on every node.
        eval_bytes: about how many held-out bytes a validation measures.
        device: where the model trains (default: :func:`lm_device`).
        held_out: the windows of the package no node trains on, if the node is to
            measure its local-only model there too.
    """

    def __init__(
        self,
        corpus: NodeCorpus,
        shape: ModelShape,
        *,
        init_seed: int = 0,
        eval_bytes: int = 4096,
        device: torch.device | None = None,
        held_out: torch.Tensor | None = None,
    ) -> None:
        self.corpus = corpus
        self.held_out = held_out
        self.shape = shape
        self.init_seed = init_seed
        self.device = device if device is not None else lm_device()
        self.model = ByteLM(shape, seed=init_seed).to(self.device)
        self._text = as_bytes(corpus.train)
        self.validation = evaluation_windows(as_bytes(corpus.validation), shape.seq_len, eval_bytes)

    def num_examples(self) -> int:
        """How many whole ``seq-len`` windows the node's training text holds (at least 1):
        its update's weight under ``weighting = "num-examples"``, which ``max-weight``
        bounds (a byte count would pass it with a few hundred kilobytes)."""
        return max(1, len(self._text) // self.shape.seq_len)

    def dataset_records(self) -> Iterator[bytes]:
        """Each training file as its path, a NUL byte and its bytes, in path order."""
        for source in self.corpus.train:
            yield source.path.encode("utf-8") + b"\0" + source.data

    def sample_batch(self, generator: torch.Generator, batch_size: int) -> Any:
        """``(inputs, targets)`` of ``batch_size`` random windows, on the model's device."""
        inputs, targets = training_windows(self._text, generator, batch_size, self.shape.seq_len)
        return inputs.to(self.device), targets.to(self.device)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The mean next-byte cross-entropy (nats) of ``model`` on the batch."""
        inputs, targets = batch
        return next_byte_loss(model, inputs, targets)

    def validation_bpb(self, params: Mapping[str, np.ndarray] | None = None) -> float:
        """Bits per byte on the node's held-out files: of a copy of the model with
        ``params`` loaded over it (``self.model`` is left alone; what ``params`` leaves
        out, such as local groups, stays the node's), or of the model itself."""
        model = self.model
        if params is not None:
            model = copy.deepcopy(self.model)
            load_broadcast(model, params, ALL_SHARED)
        return evaluate_bits_per_byte(model, self.validation)


class LmTraining(LocalOnlyTraining):
    """AdamW over an :class:`LmTrainer` and, with ``local_only``, the node's local-only
    model trained beside it (:mod:`~lensemble_flwr.simulations.local_only`)."""

    def __init__(
        self, trainer: LmTrainer, config: LensembleConfig, *, local_only: bool = True
    ) -> None:
        model = None
        if local_only:
            model = ByteLM(trainer.shape, seed=trainer.init_seed).to(trainer.device)
        super().__init__(trainer, config, local_model=model)
        self.lm = trainer

    def local_only_bpb(self, windows: torch.Tensor | None = None) -> float | None:
        """The local-only model's bits per byte on ``windows`` (default: the node's
        held-out files); None without a local-only model."""
        if self.local_only is None:
            return None
        return evaluate_bits_per_byte(
            self.local_only.model, self.lm.validation if windows is None else windows
        )
