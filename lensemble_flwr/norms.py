"""L2 norms in float64 that are the same on every machine, and fast on a busy one.

``np.dot`` of two float64 vectors goes to BLAS. OpenBLAS splits a long vector across its
threads and adds the partial sums, so the last bits of a norm depended on how many
threads it ran (the clip factor of a release, and an external step's ``change_norm``
that ``verify`` recomputes and compares exactly, with them); and on a machine whose cores
are busy, as on Flower's simulation engine, its threads wait for each other: a dot of
100k floats took 8 ms instead of 0.05 ms on 2 loaded cores. The sums here go chunk by
chunk, in a fixed order, through dots short enough that OpenBLAS runs them on the
calling thread (it splits only vectors longer than 10,000 elements), so they do not depend
on the thread count; an array of at most :data:`CHUNK` elements gets exactly the dot it
got before, which keeps the norms, and the records of runs made with them, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping

import numpy as np

CHUNK = 1 << 13  # float64 elements per dot: below OpenBLAS's threading threshold


def _float64_chunks(values: np.ndarray, minus: np.ndarray | None = None) -> Iterator[np.ndarray]:
    """``values`` (less ``minus``, of the same size), flattened, as float64 chunks of at
    most :data:`CHUNK` elements in order; each chunk overwrites the one before."""
    flat = np.asarray(values).reshape(-1)
    below = None if minus is None else np.asarray(minus).reshape(-1)
    if below is not None and below.size != flat.size:
        raise ValueError(f"change_norm: sizes differ ({below.size} != {flat.size})")
    scratch = np.empty(min(CHUNK, flat.size), np.float64)
    other = np.empty_like(scratch) if below is not None else None
    for lo in range(0, flat.size, CHUNK):
        part = scratch[: min(CHUNK, flat.size - lo)]
        np.copyto(part, flat[lo : lo + part.size], casting="unsafe")
        if below is not None and other is not None:
            base = other[: part.size]
            np.copyto(base, below[lo : lo + part.size], casting="unsafe")
            np.subtract(part, base, out=part)
        yield part


def sum_of_squares(values: Iterable[np.ndarray]) -> float:
    """Σ x² in float64 over every element of ``values``, array after array: each chunk of
    :data:`CHUNK` elements is a single-threaded dot with itself, the chunks' sums are
    added in order."""
    return _sum_of_squares((v, None) for v in values)


def _sum_of_squares(items: Iterable[tuple[np.ndarray, np.ndarray | None]]) -> float:
    total = 0.0
    for values, minus in items:
        for part in _float64_chunks(values, minus):
            total += float(np.dot(part, part))
    return total


def l2_norm(arrays: Mapping[str, np.ndarray]) -> float:
    """The L2 norm over every array of ``arrays``, taken name by name in sorted order."""
    return math.sqrt(sum_of_squares(arrays[name] for name in sorted(arrays)))


def change_norm(before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray]) -> float:
    """The L2 norm of ``after − before`` over the names of ``before``, in sorted order,
    with no model-sized temporary."""
    return math.sqrt(_sum_of_squares((after[n], before[n]) for n in sorted(before)))
