"""A node's local-only model: what the example apps measure the federation against.

:class:`LocalOnlyTraining` is the usual AdamW inner loop (:class:`TorchTraining`) plus a
second model of the node's own, built by the app from the same initial weights as the
global model. Every time the node trains for the federation, that model takes as many
AdamW steps on the same batches (the same seed), but it never takes the global model
and is never released. Its weights, its AdamW state and its step count ride in the
node's saved state (``local-only/...`` arrays and ``meta["local-only"]``), so that a node
rebuilt for an evaluate message still has it; that state stays on the node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.participant.local_training import (
    PortableState,
    TorchTraining,
    Trainer,
    deterministic_algorithms,
    inner_adamw,
    run_inner_loop,
)

LOCAL_ONLY = "local-only/"
"""The prefix of the local-only model's arrays in the node's saved state."""


@dataclasses.dataclass
class LocalOnlyView:
    """The node's data with the local-only model: what the inner loop trains."""

    model: nn.Module
    source: Trainer

    def sample_batch(self, generator: torch.Generator, batch_size: int) -> Any:
        """The node's batch, as its trainer draws it."""
        return self.source.sample_batch(generator, batch_size)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The node's loss, as its trainer computes it."""
        return self.source.loss(model, batch)


class LocalOnlyTraining(TorchTraining):
    """AdamW over ``trainer`` and, when ``local_model`` is given, that model trained
    beside it on the same batches (see the module). ``local_model`` must start from the
    weights the federation starts from; None keeps no local-only model."""

    def __init__(
        self, trainer: Trainer, config: LensembleConfig, *, local_model: nn.Module | None
    ) -> None:
        super().__init__(trainer, config)
        self.local_only: LocalOnlyView | None = None
        self.local_optimizer: torch.optim.Optimizer | None = None
        self.local_steps = 0
        if local_model is not None:
            self.local_only = LocalOnlyView(model=local_model, source=trainer)

    def fit(self, global_params: Mapping[str, np.ndarray], *, steps: int, seed: int) -> NamedArrays:
        """:meth:`TorchTraining.fit`; then the local-only model takes ``steps`` steps on
        the same batches (the same ``seed``)."""
        shared = super().fit(global_params, steps=steps, seed=seed)
        if self.local_only is not None:
            if self.local_optimizer is None:
                self.local_optimizer = inner_adamw(self.local_only.model.parameters(), self.config)
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
        self.local_optimizer = inner_adamw(self.local_only.model.parameters(), self.config)
        self.local_optimizer.load_state_dict({"state": slots, "param_groups": param_groups})


def local_only_of(run_config: Mapping[str, Any]) -> bool:
    """The app's ``local-only`` key (default true).

    Raises:
        ConfigError: it is not a boolean (a string such as ``'false'`` would read as true).
    """
    value = run_config.get("local-only", True)
    if not isinstance(value, bool):
        raise ConfigError("local-only", f"must be true or false, got {value!r}")
    return value
