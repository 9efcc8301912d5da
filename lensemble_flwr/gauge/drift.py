"""How far the latent frame of the global model moved, from public information only.

``frame_drift(adapter, probe, before, after)`` embeds the public probe with two global
models (e.g. the committed models of consecutive rounds), solves the Procrustes problem
``Q* = argmin ||Z_after Q − Z_before||`` and reports

    drift = ||Q* − I||_F / (2 √d)    ∈ [0, 1].

For orthogonal Q, ``||Q − I||_F² = 2d − 2 tr Q``: 0 when the frame did not move, 1/√2 for
a rotation with zero trace (e.g. a "typical" random rotation in high dimension), 1 for
Q = −I. It uses nothing but the two global models and the public probe, so the
coordinator can compute it on an aggregate under secure aggregation; it never sees an
individual update.

Being a diagnostic, it gives a number for any finite pair of models: Procrustes runs
with the ridge rule and no condition limit, so a direction the probe does not determine
(e.g. a latent dimension that collapsed in the averaged model) counts as not having
moved, instead of stopping the round.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from lensemble_flwr.gauge.adapter import GaugeAdapter
from lensemble_flwr.gauge.probe import Probe
from lensemble_flwr.gauge.procrustes import procrustes_align


def frame_drift(
    adapter: GaugeAdapter,
    probe: Probe,
    before: Mapping[str, np.ndarray],
    after: Mapping[str, np.ndarray],
    *,
    ridge: float = 1e-3,
) -> float:
    """The frame drift from ``before`` to ``after`` in [0, 1] (see the module docstring).

    Raises:
        DegenerateProcrustes: an embedding is non-finite or all zero (no frame at all).
    """
    z_before = adapter.embed(before, probe.inputs)
    z_after = adapter.embed(after, probe.inputs)
    alignment = procrustes_align(
        z_after, z_before, max_condition=math.inf, conditioning="ridge", ridge=ridge
    )
    d = alignment.q.shape[0]
    distance = float(np.linalg.norm(alignment.q - np.eye(d)))
    return min(1.0, distance / (2.0 * math.sqrt(d)))
