"""Synthetic sovereign data for the latent world model: one shared world, many embodiments.

The world is a latent linear dynamical system of dimension ``LATENT_DIM`` = 8, four damped
planar rotations driven by a ``CONTROL_DIM`` = 4 control::

    z_{t+1} = A z_t + B u_t + process noise,    A = 0.9 · blockdiag(R(ω_1), ..., R(ω_4))

rendered into ``OBS_DIM`` = 24 sensor channels by a fixed nonlinear map
``render(z) = tanh(W z + b)``. ``A``, ``B``, ``W`` and ``b`` are public: a function of the
world seed alone.

A participant is an *embodiment* of that world: it acts through its own number of action
dimensions (``u = M_c a``), sees the world through its own miscalibrated sensors
(per-channel gain and offset, its own noise level) and explores its own region of the
latent space (its own initial-state mean). Its trajectories are private. The public probe
is the noise-free rendering of latent states drawn from a public seed.

Two kinds of actuation. ``"subspace"`` (the gauge experiment's world, the default): 2 to
5 action dimensions, a random ``M_c``, so an embodiment with fewer than ``CONTROL_DIM``
actuators drives only a subspace of the control and explores its own part of the latent
space: the embodiments' latent distributions differ, and one shared encoder cannot whiten
them all. ``"full"`` (the main job's world): 4 to 7 action dimensions and an ``M_c`` with
orthonormal rows (redundant actuators), so every embodiment drives the whole control with
the same statistics; the embodiments differ in their actuators, sensors and start states,
and share the dynamics and the latent distribution that the shared groups learn.

Every function here is a pure function of its seeds and takes milliseconds.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import numpy as np

from lensemble_flwr.canonical import derive_seed
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.gauge.probe import Probe

LATENT_DIM, CONTROL_DIM, OBS_DIM = 8, 4, 24
ACTION_DIMS = (2, 3, 4, 5)
FULL_ACTION_DIMS = (4, 5, 6, 7)
ACTUATIONS = ("subspace", "full")
"""How an embodiment's actions reach the world's control (see :func:`make_embodiment`)."""
DAMPING = 0.9
PROCESS_NOISE = 0.05
PROBE_SIZE, PROBE_LANDMARKS = 256, 16


def _rng(*labels: str | int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(derive_seed(0, "world", *labels)))


@dataclasses.dataclass(frozen=True, eq=False)
class World:
    """The public part: latent dynamics and the sensor rendering."""

    a: np.ndarray  # (LATENT_DIM, LATENT_DIM)
    b: np.ndarray  # (LATENT_DIM, CONTROL_DIM)
    render_w: np.ndarray  # (OBS_DIM, LATENT_DIM)
    render_b: np.ndarray  # (OBS_DIM,)

    def render(self, z: np.ndarray) -> np.ndarray:
        """Noise-free observations of latent states (n × LATENT_DIM → n × OBS_DIM)."""
        return np.tanh(z @ self.render_w.T + self.render_b)


@functools.lru_cache(maxsize=8)
def make_world(seed: int = 0) -> World:
    """The shared world of ``seed`` (cached; its arrays are read-only)."""
    rng = _rng(seed, "dynamics")
    blocks = []
    for omega in (0.15, 0.35, 0.6, 0.9):
        c, s = np.cos(omega), np.sin(omega)
        blocks.append(np.array([[c, -s], [s, c]]))
    a = DAMPING * _block_diag(blocks)
    # the control drives the latent hard enough that the stationary spread is about 1
    b = rng.standard_normal((LATENT_DIM, CONTROL_DIM)) * np.sqrt((1 - DAMPING**2) / CONTROL_DIM)
    render_w = rng.standard_normal((OBS_DIM, LATENT_DIM)) * (0.8 / np.sqrt(LATENT_DIM))
    render_b = rng.standard_normal(OBS_DIM) * 0.2
    world = World(a=a, b=b, render_w=render_w, render_b=render_b)
    for array in (world.a, world.b, world.render_w, world.render_b):
        array.setflags(write=False)
    return world


def _block_diag(blocks: list[np.ndarray]) -> np.ndarray:
    size = sum(len(b) for b in blocks)
    out = np.zeros((size, size))
    at = 0
    for block in blocks:
        out[at : at + len(block), at : at + len(block)] = block
        at += len(block)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class Embodiment:
    """One participant's body and sensors (private)."""

    index: int
    control_map: np.ndarray  # (CONTROL_DIM, action_dim): u = M a
    gain: np.ndarray  # (OBS_DIM,)
    offset: np.ndarray  # (OBS_DIM,)
    sensor_noise: float
    start_mean: np.ndarray  # (LATENT_DIM,)

    @property
    def action_dim(self) -> int:
        return int(self.control_map.shape[1])


def make_embodiment(index: int, seed: int = 0, *, actuation: str = "subspace") -> Embodiment:
    """Participant ``index``'s embodiment in the world of ``seed``.

    Raises:
        ConfigError: a negative index, or an ``actuation`` not in ``ACTUATIONS``.
    """
    if index < 0:
        raise ConfigError("participant index", f"must be >= 0, got {index}")
    if actuation not in ACTUATIONS:
        raise ConfigError("actuation", f"must be one of {ACTUATIONS}, got {actuation!r}")
    rng = _rng(seed, "embodiment", index)
    dims = FULL_ACTION_DIMS if actuation == "full" else ACTION_DIMS
    action_dim = dims[index % len(dims)]
    control_map = rng.standard_normal((CONTROL_DIM, action_dim)) / np.sqrt(action_dim)
    if actuation == "full":  # orthonormal rows: u = M a ~ N(0, I) for a ~ N(0, I)
        q, r = np.linalg.qr(control_map.T)  # (action_dim, CONTROL_DIM), orthonormal columns
        control_map = (q * np.sign(np.diag(r))).T
    return Embodiment(
        index=index,
        control_map=control_map,
        gain=1.0 + 0.05 * rng.standard_normal(OBS_DIM),
        offset=0.05 * rng.standard_normal(OBS_DIM),
        sensor_noise=float(rng.uniform(0.01, 0.05)),
        start_mean=rng.standard_normal(LATENT_DIM) * 0.7,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class Transitions:
    """(o_t, a_t, o_{t+1}) triples, float32, one per row."""

    obs: np.ndarray  # (N, OBS_DIM)
    actions: np.ndarray  # (N, action_dim)
    next_obs: np.ndarray  # (N, OBS_DIM)

    def __len__(self) -> int:
        return len(self.obs)

    def records(self) -> Iterator[bytes]:
        """Canonical bytes of each transition, in order (the dataset's Merkle leaves)."""
        for i in range(len(self.obs)):
            yield self.obs[i].tobytes() + self.actions[i].tobytes() + self.next_obs[i].tobytes()


def rollout(
    world: World, body: Embodiment, rng: np.random.Generator, *, trajectories: int, steps: int
) -> Transitions:
    """``trajectories`` rollouts of ``steps`` transitions under random actions."""
    z = body.start_mean + 0.5 * rng.standard_normal((trajectories, LATENT_DIM))
    actions = rng.standard_normal((steps, trajectories, body.action_dim))
    latents = [z]
    for t in range(steps):
        u = actions[t] @ body.control_map.T
        z = z @ world.a.T + u @ world.b.T + PROCESS_NOISE * rng.standard_normal(z.shape)
        latents.append(z)
    path = np.stack(latents)  # (steps + 1, trajectories, LATENT_DIM)
    seen = world.render(path) * body.gain + body.offset
    seen = seen + body.sensor_noise * rng.standard_normal(seen.shape)

    def rows(x: np.ndarray) -> np.ndarray:  # (steps, trajectories, k) -> (N, k), float32
        return np.ascontiguousarray(x.transpose(1, 0, 2).reshape(-1, x.shape[-1]), dtype="<f4")

    return Transitions(obs=rows(seen[:-1]), actions=rows(actions), next_obs=rows(seen[1:]))


@dataclasses.dataclass(frozen=True, eq=False)
class ParticipantData:
    """One participant's embodiment, private training transitions and validation set."""

    embodiment: Embodiment
    train: Transitions
    validation: Transitions


def participant_data(
    index: int,
    *,
    seed: int = 0,
    trajectories: int = 16,
    steps: int = 32,
    validation_trajectories: int = 8,
    actuation: str = "subspace",
) -> ParticipantData:
    """Participant ``index``'s data in the world of ``seed`` (a pure function of its
    arguments): ``trajectories`` rollouts of ``steps`` transitions to train on, and
    ``validation_trajectories`` more to validate on.

    Raises:
        ConfigError: a negative index, a count below 1, or an unknown ``actuation``.
    """
    for name, count in (
        ("trajectories", trajectories),
        ("steps", steps),
        ("validation_trajectories", validation_trajectories),
    ):
        if count < 1:
            raise ConfigError(name, f"must be >= 1, got {count}")
    world = make_world(seed)
    body = make_embodiment(index, seed, actuation=actuation)
    train = rollout(world, body, _rng(seed, "train", index), trajectories=trajectories, steps=steps)
    validation = rollout(
        world,
        body,
        _rng(seed, "validation", index),
        trajectories=validation_trajectories,
        steps=steps,
    )
    return ParticipantData(embodiment=body, train=train, validation=validation)


def public_probe(
    seed: int = 0, *, size: int = PROBE_SIZE, landmarks: int = PROBE_LANDMARKS
) -> Probe:
    """The public probe of the world of ``seed``: noise-free renderings of latent states
    drawn from the world's stationary spread, and ``landmarks`` rows among them."""
    rng = _rng(seed, "probe")
    z = rng.standard_normal((size, LATENT_DIM))
    chosen = np.sort(rng.choice(size, size=min(landmarks, size), replace=False))
    return Probe(inputs=make_world(seed).render(z).astype(np.float32), landmarks=tuple(chosen))
