"""The aggregation's element-wise work as compiled single passes, when numba is installed.

numba comes with the ``fast`` extra (``pip install "lensemble-flwr[fast]"``; ``./dev.sh``
installs it). Without it, or with ``LENSEMBLE_FLWR_COMPILED_KERNELS=0``, everything runs
as numpy passes, with the same results bit for bit.

The numpy fold in :mod:`~lensemble_flwr.aggregation.fixed_point` makes several passes
over every chunk of every update (copy to float64, scale, ``rint``, cast, add), and more
over the accumulator for the checksums; the mean and the outer step make one pass per
operation. The kernels here do the same arithmetic in one pass over blocks small enough
to stay in L1, and ``tests/aggregation/test_compiled.py`` checks under hypothesis that they
give the numpy passes' bytes:

- the fold: every value is ``rint(float64(x) * scale)``, rounded half to even. Where the
  aggregator's bound guarantees ``|x * scale| < 2**51``, rounding and conversion to int64
  are done by adding ``1.5 * 2**52`` (the sum's last place is then worth 1, and
  round-to-nearest-even is the default rounding mode) and reading the integer out of the
  float's bits: exact in that range, and it vectorizes where a float64-to-int64
  conversion does not on AVX2. Above it, the kernel calls ``rint`` value by value;
- the checksums: ``sum(q * (1 + r))`` modulo 2**64 in unsigned arithmetic, which is
  ``q.sum() + q @ r`` modulo 2**64, what numpy's wrapping int64 arithmetic adds;
- the mean: ``float32(float64(v) / denominator)``, with ``float64(v)`` correctly rounded
  from its exact halves ``(v >> 32) * 2**32 + (v & 0xFFFFFFFF)``, each converted through
  the float's bits; with the self-check's checksum of the sums it reads, when asked;
- the outer step: the same float32 (or float64) operations in the same order; numba does
  not contract a multiply and an add into one rounding unless asked (no ``fastmath``).

Nothing imports numba until a tensor is large enough to use it
(:data:`COMPILED_MIN_SIZE`), so small models, most tests and Flower's ClientApp actors
never pay its import. numba compiles a kernel the first time it meets a new combination
of argument types, about a second each: for the fold, ``fold_batch`` and the dtype (a
batch shorter than ``fold_batch``, a round's last when C_t is not a multiple of it, is
padded to that length, so it does not compile a fold of its own). Kernels are cached
on disk (next to this module, or in numba's user cache or ``NUMBA_CACHE_DIR``), so later
processes load them; where no cache folder is writable, every process compiles its own.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lensemble_flwr.aggregation.chunked import CHUNK

log = logging.getLogger(__name__)

COMPILED_MIN_SIZE = 4 * CHUNK
"""Tensors with fewer elements are folded by numpy (the compiled call would not pay)."""
MAGIC_BOUND = 1 << 51
"""Below this bound on |x * scale|, rounding by adding 1.5 * 2**52 is exact."""

_BLOCK = 2048
"""Elements the kernel works on at a time: its two int64/float64 scratch blocks stay in
L1. It divides :data:`CHUNK`, so a block never straddles two chunks' checksum weights."""
assert CHUNK % _BLOCK == 0
_ENV = "LENSEMBLE_FLWR_COMPILED_KERNELS"


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The compiled range kernels; each works on ``[lo, hi)`` of flat arrays."""

    fold: Callable[..., int]
    mean: Callable[..., int]
    outer: Callable[..., None]


@functools.cache
def kernels() -> Kernels | None:
    """The compiled kernels, or None when numba is missing or switched off
    (``LENSEMBLE_FLWR_COMPILED_KERNELS=0``). The first call imports numba."""
    if os.environ.get(_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        import numba
    except ImportError as exc:  # missing, or installed against another numpy
        log.warning(
            "numba cannot be imported (%s): the aggregation runs as numpy passes (the same "
            "results, more slowly); pip install 'lensemble-flwr[fast]' compiles them",
            exc,
        )
        return None
    for cache in (True, False):  # without a writable cache folder, compile per process
        try:
            return _define(numba, cache=cache)
        except RuntimeError:  # numba's "cannot cache function": try without the cache
            continue
        except Exception as exc:  # an llvmlite that does not load: numpy does the same work
            log.warning("numba kernels unavailable (%s): the aggregation runs as numpy passes", exc)
            return None
    log.warning("numba kernels unavailable: the aggregation runs as numpy passes")
    return None


def _define(numba: Any, *, cache: bool) -> Kernels:
    """The kernels, compiled lazily (on their first call for each argument types)."""
    magic = np.float64(1.5 * 2.0**52)
    magic_bits = np.int64(magic.view(np.int64))
    two52 = np.float64(2.0**52)
    two52_bits = np.int64(two52.view(np.int64))
    two32 = np.float64(2.0**32)
    low32 = np.int64(0xFFFFFFFF)
    chunk = CHUNK
    block = _BLOCK
    jit = numba.njit(nogil=True, cache=cache, error_model="numpy", boundscheck=False)

    @jit
    def fold(acc, xs, scales, r, lo, hi, by_magic, assign):  # pragma: no cover - compiled
        q = np.empty(block, np.int64)
        t = np.empty(block, np.float64)
        tv = t.view(np.int64)
        check = np.uint64(0)
        for s in range(lo, hi, block):
            k = min(block, hi - s)
            at = (s - lo) % chunk  # the checksum weight of s: its position in its chunk
            for i in range(k):
                q[i] = 0
            for j in range(len(scales)):  # xs may be padded past the batch: not len(xs)
                x = xs[j][s : s + k]
                sc = scales[j]
                if by_magic:  # the integer read out of the float's bits
                    for i in range(k):
                        t[i] = np.float64(x[i]) * sc + magic
                    for i in range(k):
                        q[i] += tv[i] - magic_bits
                else:
                    for i in range(k):
                        q[i] += np.int64(np.rint(np.float64(x[i]) * sc))
            a, w = acc[s : s + k], r[at : at + k]
            if assign:  # the first batch: the accumulator's contents are undefined
                for i in range(k):
                    a[i] = q[i]
            else:
                for i in range(k):
                    a[i] += q[i]
            for i in range(k):
                check += np.uint64(q[i]) * (np.uint64(w[i]) + np.uint64(1))
        return check

    @jit
    def mean(sums, out, denom, r, lo, hi, with_check):  # pragma: no cover - compiled
        # float64(v), correctly rounded, from exact halves: v = hi32 * 2**32 + lo32, each
        # half converted exactly through the float's bits (no AVX2 int64 -> float64).
        hb = np.empty(block, np.int64)
        lb = np.empty(block, np.int64)
        hd, ld = hb.view(np.float64), lb.view(np.float64)
        check = np.uint64(0)
        for s in range(lo, hi, block):
            k = min(block, hi - s)
            v, o = sums[s : s + k], out[s : s + k]
            for i in range(k):
                hb[i] = (v[i] >> 32) + magic_bits
                lb[i] = (v[i] & low32) | two52_bits
            for i in range(k):
                exact = (hd[i] - magic) * two32 + (ld[i] - two52)
                o[i] = np.float32(exact / denom)
            if with_check:  # the self-check's checksum of the same block, while in L1
                at = (s - lo) % chunk
                w = r[at : at + k]
                for i in range(k):
                    check += np.uint64(v[i]) * (np.uint64(w[i]) + np.uint64(1))
        return check

    @jit
    def outer(p_in, m_in, g_in, p_out, m_out, lr, mu, nesterov, lo, hi):  # pragma: no cover
        pi, mi, gi = p_in[lo:hi], m_in[lo:hi], g_in[lo:hi]
        po, mo = p_out[lo:hi], m_out[lo:hi]
        for i in range(hi - lo):
            g = gi[i]
            m = mi[i] * mu
            m = m + g
            if nesterov:
                t = m * mu
                t = g + t
            else:
                t = m
            t = t * lr
            po[i] = pi[i] + t
            mo[i] = m  # last: m_out may be g_in's own buffer

    return Kernels(fold, mean, outer)


def available() -> bool:
    """Whether the compiled kernels are installed and not switched off."""
    return kernels() is not None


def _read_only(array: np.ndarray) -> np.ndarray:
    """A read-only view: numba types a writable and a read-only array differently, and a
    tuple of both cannot be indexed at run time; one type also means one compilation."""
    view = array.view()
    view.setflags(write=False)
    return view


def for_size(size: int) -> Kernels | None:
    """The compiled kernels for a tensor of ``size`` elements, or None where numpy's
    passes are used (numba missing or off, a tensor under :data:`COMPILED_MIN_SIZE`)."""
    return kernels() if size >= COMPILED_MIN_SIZE else None


def fold_kernel(
    inputs: Sequence[np.ndarray],
    scales: Sequence[float],
    r: np.ndarray,
    value_bound: int,
    *,
    assign: bool = False,
    slots: int = 0,
) -> Callable[[np.ndarray, int, int], int] | None:
    """A range kernel that folds ``inputs`` (flat arrays of one size, one per update, each
    multiplied by its scale) into an accumulator, or None where the numpy fold must run:
    numba missing or off, a tensor under :data:`COMPILED_MIN_SIZE`, or inputs of
    different dtypes or not contiguous.

    The returned ``kernel(acc, lo, hi)`` adds the rounded, scaled inputs over ``[lo, hi)``
    into ``acc`` (with ``assign``, writes them over whatever ``acc`` holds: the first
    batch, into an accumulator that was never zeroed) and returns their checksum (weights
    ``r``) modulo 2**64. ``value_bound`` bounds ``|x * scale|`` for every value of every
    input (the largest of the aggregator's per-update bounds). ``slots``: pad the batch
    to this many inputs for the compiled call (the padding is never read), so that every
    batch up to ``slots`` long runs the same compiled fold; 0 or fewer than the inputs,
    no padding."""
    dtype = inputs[0].dtype
    if any(x.dtype != dtype or not x.flags.c_contiguous for x in inputs):
        return None
    found = for_size(inputs[0].size)
    if found is None:
        return None
    fold, by_magic = found.fold, value_bound < MAGIC_BOUND
    xs, factors = tuple(map(_read_only, inputs)), np.array(scales, np.float64)
    xs += (xs[0],) * max(0, slots - len(xs))  # one numba type per slots, not per length

    def kernel(acc: np.ndarray, lo: int, hi: int) -> int:
        return int(fold(acc, xs, factors, r, lo, hi, by_magic, assign))

    return kernel
