"""A node of the byte language model app (apps/lm): its trainer, and its local-only twin.

:class:`LmTrainer` is the node's :class:`~lensemble_flwr.participant.local_training.Trainer`:
its source files (:mod:`lm_data`) and a :class:`~lm_model.ByteLM`, on :func:`lm_device`.
:class:`LmTraining` is the usual AdamW inner loop over it, plus what the app measures the
federation against: a second model of the node's own that starts from the same initial
weights and, every time the node trains for the federation, takes as many AdamW steps on
the same batches, but never leaves the node and never takes the global model. Its weights
and inner optimizer ride in the node's saved state (``local-only/...`` arrays), so that a
node rebuilt for an evaluate message still has it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from lensemble_flwr.config import LensembleConfig, ParamGroupsConfig
from lensemble_flwr.params import NamedArrays, load_broadcast
from lensemble_flwr.participant.local_training import (
    PortableState,
    TorchTraining,
    deterministic_algorithms,
    run_inner_loop,
)
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

ALL_SHARED = ParamGroupsConfig(shared=("*",), local=())
LOCAL_ONLY = "local-only/"
"""The prefix of the local-only model's arrays in the node's saved state."""


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


@dataclasses.dataclass
class _LocalOnlyView:
    """The node's data with the local-only model: what the inner loop trains."""

    model: nn.Module
    source: LmTrainer

    def sample_batch(self, generator: torch.Generator, batch_size: int) -> Any:
        return self.source.sample_batch(generator, batch_size)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.source.loss(model, batch)


class LmTraining(TorchTraining):
    """AdamW over an :class:`LmTrainer` and, with ``local_only``, the node's local-only
    model trained beside it (see the module)."""

    def __init__(
        self, trainer: LmTrainer, config: LensembleConfig, *, local_only: bool = True
    ) -> None:
        super().__init__(trainer, config)
        self.lm = trainer
        self.local_only: _LocalOnlyView | None = None
        self.local_optimizer: torch.optim.Optimizer | None = None
        self.local_steps = 0
        if local_only:
            model = ByteLM(trainer.shape, seed=trainer.init_seed).to(trainer.device)
            self.local_only = _LocalOnlyView(model=model, source=trainer)

    def _local_adamw(self, model: nn.Module) -> torch.optim.Optimizer:
        inner = self.config.inner
        return torch.optim.AdamW(
            model.parameters(),
            lr=inner.lr,
            betas=(inner.beta1, inner.beta2),
            eps=inner.eps,
            weight_decay=inner.weight_decay,
        )

    def fit(self, global_params: Mapping[str, np.ndarray], *, steps: int, seed: int) -> NamedArrays:
        """:meth:`TorchTraining.fit`; then the local-only model takes ``steps`` steps on
        the same batches (the same ``seed``)."""
        shared = super().fit(global_params, steps=steps, seed=seed)
        if self.local_only is not None:
            if self.local_optimizer is None:
                self.local_optimizer = self._local_adamw(self.local_only.model)
            with deterministic_algorithms(self.config.inner.deterministic):
                run_inner_loop(
                    self.local_only,  # type: ignore[arg-type]  (the inner loop's part of a Trainer)
                    self.local_optimizer,
                    steps=steps,
                    seed=seed,
                    batch_size=self.config.inner.batch_size,
                )
            self.local_steps += steps
        return shared

    def local_only_bpb(self, windows: torch.Tensor | None = None) -> float | None:
        """The local-only model's bits per byte on ``windows`` (default: the node's
        held-out files); None without a local-only model."""
        if self.local_only is None:
            return None
        return evaluate_bits_per_byte(
            self.local_only.model, self.lm.validation if windows is None else windows
        )

    def export_state(self) -> PortableState:
        """:meth:`TorchTraining.export_state`, with the local-only model's weights and
        AdamW state under ``local-only/`` and its step count in ``meta``."""
        state = super().export_state()
        if self.local_only is None:
            return state
        arrays = dict(state.arrays)
        for name, tensor in self.local_only.model.state_dict().items():
            arrays[f"{LOCAL_ONLY}model/{name}"] = tensor.detach().cpu().numpy().copy()
        groups = None
        if self.local_optimizer is not None:
            saved = self.local_optimizer.state_dict()
            for index, slots in saved["state"].items():
                for slot, value in slots.items():
                    key = f"{LOCAL_ONLY}optimizer/{index}/{slot}"
                    arrays[key] = torch.as_tensor(value).cpu().numpy().copy()
            groups = [
                {k: list(v) if isinstance(v, tuple) else v for k, v in group.items()}
                for group in saved["param_groups"]
            ]
        meta = {**state.meta, "local-only": {"steps": self.local_steps, "param_groups": groups}}
        return PortableState(arrays=arrays, meta=meta)

    def import_state(self, state: PortableState) -> None:
        """:meth:`TorchTraining.import_state`, and the local-only model's part when the
        state has one (otherwise it stays at its initial weights, with no optimizer)."""
        super().import_state(state)
        own = state.meta.get("local-only")
        if self.local_only is None or not isinstance(own, dict):
            return
        weights = f"{LOCAL_ONLY}model/"
        model_state = {
            k[len(weights) :]: torch.from_numpy(np.array(v))
            for k, v in state.arrays.items()
            if k.startswith(weights)
        }
        self.local_only.model.load_state_dict(model_state)
        self.local_steps = int(own.get("steps", 0))
        groups = own.get("param_groups")
        if groups is None:
            self.local_optimizer = None
            return
        prefix = f"{LOCAL_ONLY}optimizer/"
        slots: dict[int, dict[str, torch.Tensor]] = {}
        for name, value in state.arrays.items():
            if name.startswith(prefix):
                index, slot = name[len(prefix) :].split("/", 1)
                slots.setdefault(int(index), {})[slot] = torch.from_numpy(np.array(value))
        param_groups = [
            {k: tuple(v) if k == "betas" else v for k, v in group.items()} for group in groups
        ]
        self.local_optimizer = self._local_adamw(self.local_only.model)
        self.local_optimizer.load_state_dict({"state": slots, "param_groups": param_groups})
