"""A participant whose inner loop gives the same bits on every CPU, for the tests that pin
the bytes a run writes.

A torch model's float results depend on the machine: its matmul, tanh and randn kernels
are chosen by CPU (AVX-512 or AVX2), and so are BLAS's and numpy's summation orders. A
digest pinned on one machine then fails on another although no byte of lensemble's own
changed. Here every float operation is elementwise and rounded by IEEE 754 alike
everywhere (uniform float32 draws from an integer generator, subtract, multiply, add),
and lensemble's own norms are fixed trees (``lensemble_flwr.norms``): a federation of
these participants writes the same bytes on any machine.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping

import numpy as np

from lensemble_flwr.participant.local_training import PortableState
from lensemble_flwr.simulations.toy import D_IN, D_LATENT, D_OUT

SHAPES = {
    "encoder.bias": (D_LATENT,),
    "encoder.weight": (D_LATENT, D_IN),
    "predictor.bias": (D_OUT,),
    "predictor.weight": (D_OUT, D_LATENT),
}
"""The toy model's shared arrays, by name (the same names and shapes as its θ_0)."""


def uniform(seed: list[int], shape: tuple[int, ...]) -> np.ndarray:
    """float32 draws uniform in [-0.5, 0.5): integers from the generator, scaled exactly."""
    return np.random.default_rng(seed).random(shape, dtype=np.float32) - np.float32(0.5)


def portable_params(seed: int = 0) -> dict[str, np.ndarray]:
    """θ_0 of the toy model's shapes, drawn without torch."""
    return {name: uniform([seed, i], shape) for i, (name, shape) in enumerate(SHAPES.items())}


class PortableTrainer:
    """Heavy-ball steps towards this participant's own target, with uniform noise (a
    ``LocalTraining``: its momentum survives between rounds in its exported state)."""

    def __init__(self, index: int, *, num_examples: int = 16, seed: int = 0) -> None:
        self.index, self.seed, self.count = index, seed, num_examples
        self.momentum: dict[str, np.ndarray] = {}

    def num_examples(self) -> int:
        return self.count

    def dataset_records(self) -> Iterator[bytes]:
        rng = np.random.default_rng([self.seed, self.index, 1])
        for _ in range(self.count):
            yield rng.bytes(24)

    def _target(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return uniform([self.seed, self.index, zlib.crc32(name.encode())], shape)

    def fit(
        self, global_params: Mapping[str, np.ndarray], *, steps: int, seed: int
    ) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        local = {n: np.array(a, dtype=np.float32) for n, a in global_params.items()}
        for _ in range(steps):
            for name in sorted(local):
                theta = local[name]
                noise = rng.random(theta.shape, dtype=np.float32) - np.float32(0.5)
                grad = (theta - self._target(name, theta.shape)) + np.float32(0.1) * noise
                m = self.momentum.get(name, np.zeros_like(theta))
                self.momentum[name] = np.float32(0.9) * m + grad
                local[name] = theta - np.float32(0.05) * self.momentum[name]
        return local

    def forget(self) -> None:
        self.momentum = {}

    def export_state(self) -> PortableState:
        return PortableState(arrays={f"momentum.{n}": m.copy() for n, m in self.momentum.items()})

    def import_state(self, state: PortableState) -> None:
        prefix = "momentum."
        self.momentum = {
            n[len(prefix) :]: np.array(a, dtype=np.float32)
            for n, a in state.arrays.items()
            if n.startswith(prefix)
        }
