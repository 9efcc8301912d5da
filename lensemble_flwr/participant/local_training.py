"""A participant's inner loop, behind one small interface.

:class:`LocalTraining` is what a :class:`~lensemble_flwr.participant.participant.Participant`
trains with: given the global shared params, run H steps and return the local shared
params. Two implementations ship: :class:`TorchTraining` (H AdamW steps over a
:class:`Trainer`, the usual case) and, in ``lensemble_flwr.clients``, one that calls an
existing Flower ``NumPyClient.fit``.

Everything a LocalTraining must remember between rounds (inner optimizer state, local
groups such as action heads) is exported as a :class:`PortableState` — named arrays plus
JSON-able metadata — so that a participant can live in a process that only exists for
one message (a Flower SuperNode starts one per message) and keep its state elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.params import (
    NamedArrays,
    check_group_patterns,
    export_named,
    load_broadcast,
)


@dataclasses.dataclass(frozen=True)
class PortableState:
    """State that survives between messages: named arrays and JSON-able metadata."""

    arrays: NamedArrays = dataclasses.field(default_factory=dict)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


class Trainer(Protocol):
    """A participant's torch model and private data, as the AdamW inner loop needs them."""

    model: torch.nn.Module

    def num_examples(self) -> int:
        """Number of private training examples."""

    def dataset_records(self) -> Iterable[bytes]:
        """Canonical bytes of every private example, in a fixed order (the Merkle leaves)."""

    def sample_batch(self, generator: torch.Generator, batch_size: int) -> Any:
        """A training batch drawn with ``generator`` (so the inner loop is seeded)."""

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The scalar training loss of ``model`` on ``batch``.

        A Trainer may also define ``configure(config: Mapping[str, Any]) -> None``: on a
        Flower node it is called with each train instruction's user config (what the
        server passed as ``train_config``, and ``server-round``) before the round."""


@runtime_checkable
class LocalTraining(Protocol):
    """The inner loop of one participant."""

    def num_examples(self) -> int:
        """Number of private training examples (the update's weight under num-examples)."""

    def dataset_records(self) -> Iterable[bytes] | None:
        """The records the participant commits to, or None if it cannot commit (its
        updates are then unbound)."""

    def fit(self, global_params: Mapping[str, np.ndarray], *, steps: int, seed: int) -> NamedArrays:
        """Start from ``global_params``, train ``steps`` steps seeded by ``seed``, and return
        the local shared params (same names and shapes)."""

    def forget(self) -> None:
        """Discard stale local state (a rejoiner starts its inner optimizer afresh)."""

    def export_state(self) -> PortableState:
        """What must survive until the next round."""

    def import_state(self, state: PortableState) -> None:
        """Restore what :meth:`export_state` returned. A kept participant may be handed
        a state another process saved after the one it last exported, so this must
        overwrite everything the state covers, not only read back its own export."""


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """Run the block under ``torch.use_deterministic_algorithms(enabled)``, then restore."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def run_inner_loop(
    trainer: Trainer,
    optimizer: torch.optim.Optimizer,
    *,
    steps: int,
    seed: int,
    batch_size: int,
) -> float:
    """H optimizer steps on batches drawn from a generator seeded with ``seed``.

    Returns:
        The loss of the last step.
    """
    generator = torch.Generator().manual_seed(seed)
    # Dropout and other layers draw from the CPU default generator. (torch.manual_seed
    # would also queue seeding of every accelerator backend, ~0.25 ms a call on CPU.)
    torch.random.default_generator.manual_seed(seed)
    trainer.model.train()
    loss_value = float("nan")
    for _ in range(steps):
        batch = trainer.sample_batch(generator, batch_size)
        optimizer.zero_grad(set_to_none=True)
        loss = trainer.loss(trainer.model, batch)
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
    return loss_value


def inner_adamw(
    params: Iterable[torch.nn.Parameter], config: LensembleConfig, *, lr: float | None = None
) -> torch.optim.AdamW:
    """The inner optimizer of ``config`` over ``params``: AdamW with its betas, eps and
    weight decay, at ``lr`` (default: its ``inner-lr``). Participants train with it, and
    the example apps' baselines with the same settings."""
    inner = config.inner
    return torch.optim.AdamW(
        params,
        lr=inner.lr if lr is None else lr,
        betas=(inner.beta1, inner.beta2),
        eps=inner.eps,
        weight_decay=inner.weight_decay,
    )


class TorchTraining:
    """H AdamW steps over a :class:`Trainer`, under deterministic algorithms.

    The AdamW state persists across rounds (DiLoCo's inner optimizer) and, with the
    model's local groups and integer buffers, is what :meth:`export_state` carries.
    """

    def __init__(self, trainer: Trainer, config: LensembleConfig) -> None:
        check_group_patterns(trainer.model.state_dict(), config.groups)
        self.trainer = trainer
        self.config = config
        self.optimizer: torch.optim.Optimizer | None = None
        self.last_loss: float | None = None
        # what the coordinator broadcast last: the names this participant federates (the
        # rest of the model is its own, and is what export_state keeps)
        self.federated: list[str] | None = None

    def use_instruction_config(self, config: Mapping[str, Any]) -> None:
        """Hand the round's user config to the Trainer, if it has ``configure``."""
        configure = getattr(self.trainer, "configure", None)
        if callable(configure):
            configure(dict(config))

    def num_examples(self) -> int:
        """The trainer's number of private examples."""
        return int(self.trainer.num_examples())

    def dataset_records(self) -> Iterable[bytes] | None:
        """The trainer's records, the leaves of its dataset commitment."""
        return self.trainer.dataset_records()

    def _ensure_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.optimizer = inner_adamw(self.trainer.model.parameters(), self.config)
        return self.optimizer

    def fit(self, global_params: Mapping[str, np.ndarray], *, steps: int, seed: int) -> NamedArrays:
        """Load ``global_params`` into the model, run ``steps`` AdamW steps seeded by
        ``seed`` (keeping the optimizer from earlier rounds), and return the params it
        federates. The last step's loss is kept in ``last_loss``."""
        self.federated = load_broadcast(self.trainer.model, global_params, self.config.groups)
        optimizer = self._ensure_optimizer()
        with deterministic_algorithms(self.config.inner.deterministic):
            self.last_loss = run_inner_loop(
                self.trainer,
                optimizer,
                steps=steps,
                seed=seed,
                batch_size=self.config.inner.batch_size,
            )
        return export_named(self.trainer.model, self.federated)

    def forget(self) -> None:
        """Drop the AdamW state; the next :meth:`fit` starts a fresh optimizer."""
        self.optimizer = None

    def export_state(self) -> PortableState:
        """The model's state less the params it federates (local groups, integer buffers)
        as ``model/...`` arrays, and the AdamW state, if any, as ``optimizer/...`` arrays
        with its parameter groups in ``meta``."""
        federated = set(self.federated or ())
        arrays: NamedArrays = {
            f"model/{name}": tensor.detach().cpu().numpy().copy()
            for name, tensor in self.trainer.model.state_dict().items()
            if name not in federated
        }
        meta: dict[str, Any] = {"optimizer": None, "federated": self.federated}
        if self.optimizer is not None:
            opt = self.optimizer.state_dict()
            for index, slots in opt["state"].items():
                for slot, value in slots.items():
                    arrays[f"optimizer/{index}/{slot}"] = torch.as_tensor(value).cpu().numpy()
            meta["optimizer"] = {
                "param_groups": [
                    {k: list(v) if isinstance(v, tuple) else v for k, v in group.items()}
                    for group in opt["param_groups"]
                ],
            }
        return PortableState(arrays=arrays, meta=meta)

    def import_state(self, state: PortableState) -> None:
        """Restore what :meth:`export_state` returned (without optimizer state, the next
        :meth:`fit` starts a fresh optimizer)."""
        model_state = {
            name[len("model/") :]: torch.from_numpy(np.array(value))
            for name, value in state.arrays.items()
            if name.startswith("model/")
        }
        if model_state:
            self.trainer.model.load_state_dict(model_state, strict=False)
        federated = state.meta.get("federated")
        self.federated = list(federated) if federated is not None else None
        opt_meta = state.meta.get("optimizer")
        if opt_meta is None:
            self.optimizer = None
            return
        slots: dict[int, dict[str, torch.Tensor]] = {}
        for name, value in state.arrays.items():
            if name.startswith("optimizer/"):
                _, index, slot = name.split("/", 2)
                slots.setdefault(int(index), {})[slot] = torch.from_numpy(np.array(value))
        groups = [
            {k: tuple(v) if k == "betas" else v for k, v in group.items()}
            for group in opt_meta["param_groups"]
        ]
        self._ensure_optimizer().load_state_dict({"state": slots, "param_groups": groups})


def as_local_training(trainer: Trainer | LocalTraining, config: LensembleConfig) -> LocalTraining:
    """``trainer`` itself if it already is a LocalTraining, else AdamW over it."""
    if isinstance(trainer, LocalTraining):
        return trainer
    return TorchTraining(trainer, config)
