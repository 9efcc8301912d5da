"""L2 norms in float64 that are the same on every machine, and fast on a busy one.

A norm enters what a run records and hashes: the clip factor of every release, the
coordinator's ``mean_delta_l2`` diagnostic (in the manifest entry that the ledger record
commits to), an external step's ``change_norm`` that ``verify`` recomputes. So it must be
the same bits wherever it is computed. ``np.dot`` is not: OpenBLAS splits a long vector
across its threads (the last bits depended on the thread count, and on 2 busy cores a dot
of 100k floats took 8 ms instead of 0.05 ms), and it picks its kernel by CPU, so a
SkylakeX (AVX-512) and a Haswell (AVX2) kernel accumulate in different orders. numpy's
own ``sum`` is no better: its float loops are compiled per CPU feature level.

Here every float operation is one that IEEE 754 rounds exactly the same everywhere: a
conversion to float64, an elementwise subtraction or square, an elementwise add of two
arrays, a Python float add. The values of every array, one after the other, fill a
buffer of :data:`CHUNK` squares; each full buffer (and the last, padded with zeros to a
power of two) is summed as a fixed pairwise tree, the upper half added onto the lower
until one element is left, and the buffers' sums are added in order. So many small
arrays share one tree, and the error is O(log n) roundings, smaller than a running
sum's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

CHUNK = 1 << 16
"""float64 squares per pairwise tree (512 KiB: fits a core's cache)."""


def sum_of_squares(values: Iterable[np.ndarray]) -> float:
    """Σ x² in float64 over every element of ``values``, array after array, as fixed
    pairwise trees of :data:`CHUNK` squares whose sums are added in order."""
    return _sum_of_squares((v, None) for v in values)


def _sum_of_squares(items: Iterable[tuple[np.ndarray, np.ndarray | None]]) -> float:
    """Σ (values − minus)² over ``items`` (``minus`` None: Σ values²), flattened in order;
    each value converted to float64 first (so ``minus`` of a wider dtype, such as
    longdouble, cannot move the result), one array's flattened copy at a time."""
    pairs, count = [], 0
    for values, minus in items:
        values, minus = np.asarray(values), None if minus is None else np.asarray(minus)
        if minus is not None and minus.size != values.size:
            raise ValueError(f"change_norm: sizes differ ({minus.size} != {values.size})")
        pairs.append((values, minus))
        count += values.size
    if not count:
        return 0.0
    squares = np.empty(min(CHUNK, 1 << (count - 1).bit_length()), np.float64)
    total, fill = 0.0, 0
    for values, minus in pairs:
        flat = values.reshape(-1)
        below = None if minus is None else minus.reshape(-1)
        lo = 0
        while lo < flat.size:
            if fill == squares.size:
                total += _tree_sum(squares, fill)
                fill = 0
            k = min(squares.size - fill, flat.size - lo)
            part = squares[fill : fill + k]
            np.copyto(part, flat[lo : lo + k], casting="unsafe")
            if below is not None:
                np.subtract(
                    part, below[lo : lo + k], out=part, dtype=np.float64, casting="unsafe"
                )
            np.multiply(part, part, out=part)
            fill, lo = fill + k, lo + k
    return total + _tree_sum(squares, fill)


def _tree_sum(squares: np.ndarray, count: int) -> float:
    """The sum of ``squares[:count]`` as a fixed pairwise tree, in place: zeros up to the
    next power of two, then the upper half added onto the lower until one is left."""
    width = 1 << (count - 1).bit_length()  # <= squares.size: a power of two >= count
    squares[count:width] = 0.0
    while width > 1:
        width //= 2
        np.add(squares[:width], squares[width : 2 * width], out=squares[:width])
    return float(squares[0])


def l2_norm(arrays: Mapping[str, np.ndarray]) -> float:
    """The L2 norm over every array of ``arrays``, taken name by name in sorted order."""
    return math.sqrt(sum_of_squares(arrays[name] for name in sorted(arrays)))


def change_norm(before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray]) -> float:
    """The L2 norm of ``after − before`` over the names of ``before``, in sorted order,
    with no model-sized temporary."""
    return math.sqrt(_sum_of_squares((after[n], before[n]) for n in sorted(before)))
