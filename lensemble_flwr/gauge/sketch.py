"""The round's probe sketch A: a seeded random combination of probe points.

Procrustes runs on ``A @ Z_local`` against ``A @ Z_global`` (m × d) instead of the raw
n × d probe embeddings. Every participant derives the same A from the round seed, so all
of them align on the same sketched probe, and A changes every round, so no fixed subset
of probe rows decides the frame. An update carries :func:`sketch_fingerprint` of the A it
used; the coordinator computes the round's fingerprint once and refuses an update that
carries another (``federation.alignment.check_sketch``).
"""

from __future__ import annotations

import numpy as np

from lensemble_flwr.canonical import derive_seed, digest_arrays
from lensemble_flwr.errors import ConfigError, GaugeError


def sketch_matrix(round_seed: int, rows: int, probe_size: int) -> np.ndarray:
    """A (rows × probe_size, float64), i.i.d. N(0, 1/rows), a pure function of its arguments.

    The generator is numpy's PCG64 seeded with ``derive_seed(round_seed, "sketch")``.

    Raises:
        ConfigError: a negative seed, or fewer than one row or probe point.
    """
    if int(round_seed) < 0:
        raise ConfigError("round_seed", f"must be >= 0, got {round_seed}")
    if int(rows) < 1:
        raise ConfigError("gauge.sketch_rows", f"must be >= 1, got {rows}")
    if int(probe_size) < 1:
        raise ConfigError("probe size", f"must be >= 1, got {probe_size}")
    rng = np.random.Generator(np.random.PCG64(derive_seed(int(round_seed), "sketch")))
    return rng.standard_normal((int(rows), int(probe_size))) / np.sqrt(int(rows))


def sketch_fingerprint(a: np.ndarray) -> str:
    """Digest of a sketch matrix (its shape and float64 bytes).

    Raises:
        GaugeError: ``a`` is not a finite 2-D array.
    """
    a = np.asarray(a)
    if a.ndim != 2 or not np.issubdtype(a.dtype, np.number) or not np.all(np.isfinite(a)):
        raise GaugeError(f"a sketch matrix is a finite 2-D array, got shape {a.shape}")
    return digest_arrays({"sketch": np.asarray(a, dtype="<f8")}, "gauge-sketch")
