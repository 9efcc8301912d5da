"""int8 quantization of a release, with unbiased stochastic rounding.

Each tensor is sent as int8 values q and one float scale s = max|Δ| / 127; the released
value is exactly q·s. Rounding is stochastic, q = floor(Δ/s + u) with u ~ U[0, 1), so
E[q·s] = Δ and the error of each coordinate is below one step s. Bytes on the wire drop
about 4x against float32.

The rounding draws from a generator seeded by the round seed and the participant id:
a release that is reproducible without quantization stays reproducible with it. (A
noised release is random anyway; rounding it with independent, predictable randomness
is post-processing and costs no privacy.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lensemble_flwr.canonical import derive_seed
from lensemble_flwr.errors import RoundError
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.release.pipeline import (
    Release,
    ReleaseContext,
    ReleaseTransform,
    Stage,
    no_state,
)

LEVELS = 127


def quantize_int8(x: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """``(q, scale)`` with ``q`` int8 in [-127, 127] and ``E[q * scale] == x``."""
    x64 = np.asarray(x, dtype=np.float64)
    peak = float(np.max(np.abs(x64))) if x64.size else 0.0
    if peak == 0.0:
        return np.zeros(x64.shape, np.int8), 1.0
    scale = peak / LEVELS
    q = np.floor(x64 / scale + rng.random(x64.shape))
    return np.clip(q, -LEVELS, LEVELS).astype(np.int8), scale


def dequantize(q: NamedArrays, scales: dict[str, float]) -> NamedArrays:
    """The released values ``q * scale`` (float64, exact)."""
    return {n: q[n].astype(np.float64) * scales[n] for n in sorted(q)}


def int8_quantize() -> ReleaseTransform:
    """Quantize every tensor of the delta to int8 with a per-tensor scale."""

    def update(release: Release, state: Any, ctx: ReleaseContext) -> tuple[Release, Any]:
        if release.delta is None:
            raise RoundError("int8_quantize: no delta to quantize")
        rng = np.random.default_rng(derive_seed(ctx.round_seed, "quantize", ctx.participant_id))
        quantized, scales = {}, {}
        for name in sorted(release.delta):
            quantized[name], scales[name] = quantize_int8(release.delta[name], rng)
        meta = {**release.metadata, "scales": scales}
        return release.replace(delta=quantized, metadata=meta), state

    return ReleaseTransform("int8_quantize", Stage.QUANTIZE, no_state, update)
