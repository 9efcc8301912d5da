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
from collections.abc import Iterable, Mapping

import numpy as np

CHUNK = 1 << 13  # float64 elements per dot: below OpenBLAS's threading threshold


def sum_of_squares(values: Iterable[np.ndarray | tuple[np.ndarray, np.ndarray]]) -> float:
    """Σ x² in float64 over every element of ``values``, in order.

    An item is an array, or a pair ``(a, b)`` of arrays of one size, which counts
    ``b − a`` (computed in float64, chunk by chunk, with no model-sized temporary).
    Each chunk of :data:`CHUNK` elements is a single-threaded dot with itself; the
    chunks' sums are added in order.
    """
    total = 0.0
    scratch = np.empty(CHUNK, np.float64)
    other = None
    for item in values:
        if isinstance(item, tuple):
            a, b = (np.asarray(x).reshape(-1) for x in item)
            if a.size != b.size:
                raise ValueError(f"sum_of_squares: sizes differ ({a.size} != {b.size})")
            if other is None:
                other = np.empty(CHUNK, np.float64)
        else:
            a, b = None, np.asarray(item).reshape(-1)
        for lo in range(0, b.size, CHUNK):
            part = scratch[: min(CHUNK, b.size - lo)]
            np.copyto(part, b[lo : lo + part.size], casting="unsafe")
            if a is not None:
                assert other is not None
                base = other[: part.size]
                np.copyto(base, a[lo : lo + part.size], casting="unsafe")
                np.subtract(part, base, out=part)
            total += float(np.dot(part, part))
    return total


def l2_norm(arrays: Mapping[str, np.ndarray]) -> float:
    """The L2 norm over every array of ``arrays``, taken name by name in sorted order."""
    return math.sqrt(sum_of_squares(arrays[name] for name in sorted(arrays)))


def change_norm(before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray]) -> float:
    """The L2 norm of ``after − before`` over the names of ``before``, in sorted order."""
    return math.sqrt(sum_of_squares((before[name], after[name]) for name in sorted(before)))
