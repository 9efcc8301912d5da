"""A small latent world model in torch, its gauge adapter, and its federation trainer.

Shared groups (the config defaults): ``encoder`` θ maps an observation to a latent z ∈ R^d;
``predictor`` φ maps [z, e] to the next latent, ``z + MLP([z, e])``. Local group:
``action_head`` ψ maps this participant's actions (its own action dimension) to the action
embedding e. The loss on a transition (o, a, o') is

    ||predictor(encoder(o), ψ(a)) − encoder(o')||² / d  +  λ ||E[z zᵀ] − I||_F² / d

where the second term (anti-collapse, in the spirit of VICReg's covariance term) keeps
the latents' second moment at the identity over the batch of z and z'. Both terms are
invariant under z → z Q for every orthogonal Q, so the loss cannot tell latent frames
apart: the gauge. The moment is *uncentered* on purpose: it pins the origin, so the
gauge group is exactly O(d) (no translations), which is the group Procrustes solves for.

The action embedding e enters the predictor through its own input columns, not added to
z, so it is not in the latent frame: a change of frame rotates the encoder's output layer
(rows), the predictor's first layer (only its z-columns) and its output layer (rows and
bias); :class:`WorldModelAdapter` does exactly that.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from lensemble_flwr.canonical import derive_seed
from lensemble_flwr.config import LensembleConfig, ParamGroupsConfig
from lensemble_flwr.errors import ParameterMismatch
from lensemble_flwr.params import NamedArrays, export_shared, load_shared
from lensemble_flwr.participant.local_training import TorchTraining
from lensemble_flwr.simulations.world_data import (
    LATENT_DIM,
    OBS_DIM,
    ParticipantData,
    Transitions,
)

HIDDEN, EMBED_DIM = 64, 8
MOMENT_WEIGHT = 1.0
WORLD_GROUPS = ParamGroupsConfig(shared=("encoder", "predictor"), local=("action_head",))
"""The world model's parameter groups (the config's defaults)."""


class Encoder(nn.Module):
    """observation (OBS_DIM) → latent (d)."""

    def __init__(self, obs_dim: int, latent_dim: int) -> None:
        super().__init__()
        self.hidden = nn.Sequential(nn.Linear(obs_dim, HIDDEN), nn.Tanh())
        self.out = nn.Linear(HIDDEN, latent_dim)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.out(self.hidden(obs))


class Predictor(nn.Module):
    """[z, e] → next z, as a residual: z + out(tanh(inp([z, e])))."""

    def __init__(self, latent_dim: int, embed_dim: int) -> None:
        super().__init__()
        self.inp = nn.Linear(latent_dim + embed_dim, HIDDEN)
        self.out = nn.Linear(HIDDEN, latent_dim)

    def forward(self, z: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return z + self.out(torch.tanh(self.inp(torch.cat([z, e], dim=-1))))


class WorldModel(nn.Module):
    """Encoder and predictor (shared) and this embodiment's action head (local).

    Args:
        action_dim: this participant's action dimension.
        seed: seed of the shared groups (the same for everyone: one initial global model).
        head_seed: seed of the action head (each participant's own).
    """

    def __init__(
        self,
        action_dim: int,
        *,
        seed: int = 0,
        head_seed: int = 0,
        obs_dim: int = OBS_DIM,
        latent_dim: int = LATENT_DIM,
        embed_dim: int = EMBED_DIM,
    ) -> None:
        super().__init__()
        self.encoder = Encoder(obs_dim, latent_dim)
        self.predictor = Predictor(latent_dim, embed_dim)
        self.action_head = nn.Linear(action_dim, embed_dim)
        _init(nn.ModuleList([self.encoder, self.predictor]), seed)
        _init(self.action_head, head_seed)

    def loss(
        self, obs: torch.Tensor, actions: torch.Tensor, next_obs: torch.Tensor
    ) -> torch.Tensor:
        """Latent prediction loss plus the anti-collapse moment term (module docstring)."""
        z, z_next = self.encoder(obs), self.encoder(next_obs)
        predicted = self.predictor(z, self.action_head(actions))
        d = z.shape[-1]
        prediction = (predicted - z_next).pow(2).sum(dim=-1).mean() / d
        both = torch.cat([z, z_next])
        moment = both.T @ both / len(both)  # (d, d), uncentered
        eye = torch.eye(d, dtype=moment.dtype)
        return prediction + MOMENT_WEIGHT * (moment - eye).pow(2).sum() / d


def _init(module: nn.Module, seed: int) -> None:
    """torch's default Linear init, from a generator of our own (a function of ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, nn.Linear):
                bound = 1.0 / np.sqrt(layer.in_features)
                for p in (layer.weight, layer.bias):
                    p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)


def initial_params(seed: int = 0) -> NamedArrays:
    """θ_0 and φ_0: the shared groups of a fresh world model (no action head)."""
    return export_shared(WorldModel(action_dim=1, seed=seed), WORLD_GROUPS)


class WorldModelAdapter:
    """The gauge adapter of :class:`WorldModel` (implements ``GaugeAdapter``).

    In the row convention z' = z Q, a change of frame maps (W = weight, b = bias)::

        encoder.out:        W ← Qᵀ W,      b ← Qᵀ b      (the latent leaves here)
        predictor.inp:      W[:, :d] ← W[:, :d] Q        (the latent enters; e-columns kept)
        predictor.out:      W ← Qᵀ W,      b ← Qᵀ b      (the residual's increment)

    Everything else is copied.
    """

    def __init__(self, latent_dim: int = LATENT_DIM, obs_dim: int = OBS_DIM) -> None:
        self.latent_dim = latent_dim
        self.frame_names = (
            "encoder.out.bias",
            "encoder.out.weight",
            "predictor.inp.weight",
            "predictor.out.bias",
            "predictor.out.weight",
        )
        self._encoder = Encoder(obs_dim, latent_dim)
        self._encoder_names = tuple(n for n, _ in self._encoder.named_parameters())

    def embed(self, params: Mapping[str, np.ndarray], inputs: np.ndarray) -> np.ndarray:
        """The encoder's latents of ``inputs`` (n × obs_dim) under ``params`` (float32)."""
        try:
            weights = {
                name: torch.tensor(np.asarray(params[f"encoder.{name}"], dtype=np.float32))
                for name in self._encoder_names
            }
        except KeyError as exc:
            raise ParameterMismatch(f"embed: no encoder tensor {exc.args[0]}") from None
        with torch.no_grad():
            x = torch.tensor(np.asarray(inputs, dtype=np.float32))
            return functional_call(self._encoder, weights, (x,)).numpy()

    def rotate(self, params: Mapping[str, np.ndarray], q: np.ndarray) -> dict[str, np.ndarray]:
        """The same network in the frame rotated by ``q`` (see the class docstring)."""
        d = self.latent_dim
        q = np.asarray(q, dtype=np.float64)
        if q.shape != (d, d) or not np.all(np.isfinite(q)):
            raise ParameterMismatch(f"rotate: q must be a finite {d} x {d} matrix, got {q.shape}")
        missing = [n for n in self.frame_names if n not in params]
        if missing:
            raise ParameterMismatch(f"rotate: the params lack the frame tensors {missing}")
        out = {name: np.array(value, copy=True) for name, value in params.items()}

        def put(name: str, value: np.ndarray) -> None:
            out[name] = value.astype(np.asarray(params[name]).dtype)

        def f64(name: str) -> np.ndarray:
            return np.asarray(params[name], dtype=np.float64)

        for layer in ("encoder.out", "predictor.out"):
            put(f"{layer}.weight", q.T @ f64(f"{layer}.weight"))
            put(f"{layer}.bias", f64(f"{layer}.bias") @ q)
        inp = f64("predictor.inp.weight").copy()
        inp[:, :d] = inp[:, :d] @ q
        put("predictor.inp.weight", inp)
        return out


def random_orthogonal(d: int, seed: int) -> np.ndarray:
    """A Haar-random d × d orthogonal matrix (reflections included) from ``seed``."""
    rng = np.random.Generator(np.random.PCG64(seed))
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return q * np.sign(np.diag(r))


class WorldTrainer:
    """One participant's world model and private transitions (implements the Trainer).

    Args:
        data: the participant's embodiment and transitions.
        init_seed: seed of the shared groups before the first global state arrives.
    """

    def __init__(self, data: ParticipantData, *, init_seed: int = 0) -> None:
        self.data = data
        self.model = WorldModel(
            data.embodiment.action_dim,
            seed=init_seed,
            head_seed=derive_seed(init_seed, "action-head", data.embodiment.index),
        )
        train = data.train
        self._train = tuple(map(torch.from_numpy, (train.obs, train.actions, train.next_obs)))
        val = data.validation
        self._validation = tuple(map(torch.from_numpy, (val.obs, val.actions, val.next_obs)))

    def num_examples(self) -> int:
        """The number of training transitions."""
        return len(self.data.train)

    def dataset_records(self) -> Iterator[bytes]:
        """The training transitions as canonical bytes, in order (``Transitions.records``)."""
        return self.data.train.records()

    def sample_batch(self, generator: torch.Generator, batch_size: int) -> Any:
        """``(obs, actions, next_obs)`` of ``batch_size`` training transitions drawn with
        replacement."""
        idx = torch.randint(len(self.data.train), (batch_size,), generator=generator)
        return tuple(t[idx] for t in self._train)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """``WorldModel.loss`` on the batch: latent prediction plus the anti-collapse term."""
        return model.loss(*batch)

    def validation_loss(self, params: Mapping[str, np.ndarray] | None = None) -> float:
        """The loss on the validation set with this participant's action head and the
        given shared ``params`` (default: the model's own); ``self.model`` is untouched.

        Raises:
            ParameterMismatch: ``params`` are not exactly the model's shared tensors.
        """
        return self._full_loss(self._validation, params)

    def train_loss(self, params: Mapping[str, np.ndarray] | None = None) -> float:
        """The loss on the whole training set (not a mini-batch), with this participant's
        action head and the given shared ``params`` (default: the model's own).

        Raises:
            ParameterMismatch: ``params`` are not exactly the model's shared tensors.
        """
        return self._full_loss(self._train, params)

    def loss_on(
        self, transitions: Transitions, params: Mapping[str, np.ndarray] | None = None
    ) -> float:
        """The loss on ``transitions`` (e.g. one half of the validation set), with this
        participant's action head and the given shared ``params`` (default: the model's
        own).

        Raises:
            ParameterMismatch: ``params`` are not exactly the model's shared tensors.
        """
        tensors = (transitions.obs, transitions.actions, transitions.next_obs)
        return self._full_loss(tuple(map(torch.from_numpy, tensors)), params)

    def _full_loss(
        self, data: tuple[torch.Tensor, ...], params: Mapping[str, np.ndarray] | None
    ) -> float:
        model = self.model
        if params is not None:
            model = copy.deepcopy(self.model)
            load_shared(model, params, WORLD_GROUPS)
        with torch.no_grad():
            return float(model.loss(*data))


class WorldTraining(TorchTraining):
    """AdamW over a :class:`WorldTrainer`, optionally in a participant-specific frame.

    With ``rotate_start`` the participant composes every global model it receives with
    its own fixed random orthogonal matrix R_c (seeded by ``rotation_seed``) before the
    inner loop: it computes the same function, in another latent frame. It is the
    experiment's model of frame drift (see ``docs/gauge.md``): nothing in the loss pins
    the frame, so a participant is free to train in any rotated copy of it, and here each
    one does, in its own.
    """

    def __init__(
        self,
        trainer: WorldTrainer,
        config: LensembleConfig,
        *,
        rotate_start: bool = False,
        rotation_seed: int = 0,
        adapter: WorldModelAdapter | None = None,
    ) -> None:
        super().__init__(trainer, config)
        self.adapter = adapter or WorldModelAdapter()
        self.rotation: np.ndarray | None = None
        if rotate_start:
            self.rotation = random_orthogonal(
                self.adapter.latent_dim,
                derive_seed(rotation_seed, "start-rotation", trainer.data.embodiment.index),
            )

    def fit(self, global_params: Mapping[str, np.ndarray], *, steps: int, seed: int) -> NamedArrays:
        """:meth:`TorchTraining.fit`, from ``global_params`` rotated into this participant's
        frame when it has one."""
        start = global_params
        if self.rotation is not None:
            start = self.adapter.rotate(global_params, self.rotation)
        return super().fit(start, steps=steps, seed=seed)
