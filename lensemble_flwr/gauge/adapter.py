"""What the gauge machinery needs to know about a model: where its latent frame lives.

A latent world model's shared weights define a latent frame only up to an orthogonal
transform Q: rotating the encoder's output layer by Q and counter-rotating every layer that
reads or writes the latent leaves the network's function, and its loss, unchanged. A
:class:`GaugeAdapter` names those layers (:attr:`~GaugeAdapter.frame_names`), embeds probe
inputs with given weights (:meth:`~GaugeAdapter.embed`) and applies a change of frame to a
full set of shared weights (:meth:`~GaugeAdapter.rotate`). The alignment code is generic;
one adapter per model family carries the model-specific part.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class GaugeAdapter(Protocol):
    """A model family's latent frame, as the gauge machinery sees it."""

    @property
    def latent_dim(self) -> int:
        """d, the dimension of the latent."""

    @property
    def frame_names(self) -> tuple[str, ...]:
        """The shared parameter names that carry the latent frame in or out."""

    def embed(self, params: Mapping[str, np.ndarray], inputs: np.ndarray) -> np.ndarray:
        """The encoder's latents (n × d) of ``inputs`` under the shared ``params``."""

    def rotate(self, params: Mapping[str, np.ndarray], q: np.ndarray) -> dict[str, np.ndarray]:
        """New shared params in the frame rotated by the orthogonal ``q`` (d × d).

        ``embed(rotate(p, q), x) == embed(p, x) @ q`` and the network computes the same
        function in the new frame. Names outside :attr:`frame_names` are copied
        unchanged; every array keeps its dtype.
        """
