"""Shamir secret sharing of 32-byte secrets over the prime field GF(2**521 - 1).

A secret is split into n shares so that any ``threshold`` of them recover it and fewer
reveal nothing. Shares are (x, y) with x = 1..n; coefficients come from ``secrets``.
"""

from __future__ import annotations

import functools
import operator
import secrets
from collections.abc import Mapping, Sequence

import numpy as np

from lensemble_flwr.errors import SecureAggregationError

PRIME = 2**521 - 1
SECRET_BYTES = 32
Share = tuple[int, int]


def split(secret: bytes, threshold: int, count: int) -> list[Share]:
    """``count`` shares of ``secret``, any ``threshold`` of which recover it."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"secrets are {SECRET_BYTES} bytes")
    if not 1 <= threshold <= count:
        raise ValueError(f"threshold {threshold} must be in [1, {count}]")
    coefficients = [int.from_bytes(secret, "big")] + [
        secrets.randbelow(PRIME) for _ in range(threshold - 1)
    ]
    return list(zip(range(1, count + 1), _evaluate(coefficients, count), strict=True))


_REDUCE_EVERY = 16
"""Horner steps between reductions mod PRIME in :func:`_evaluate` (each step adds at most
log2(count) bits to a value)."""


def _evaluate(coefficients: Sequence[int], count: int) -> list[int]:
    """The polynomial with these coefficients (constant first) at x = 1..count, mod PRIME.

    Horner's rule for all x at once, on an array of Python ints (numpy loops over the x in
    C, not the interpreter) and reduced every few steps: the same values as reducing at
    every step, in a fraction of the time (a round costs every member ``count`` x
    ``threshold`` steps)."""
    xs = np.arange(1, count + 1).astype(object)
    ys = np.zeros(count, dtype=object)
    for step, c in enumerate(reversed(coefficients), start=1):
        np.multiply(ys, xs, out=ys)
        np.add(ys, c, out=ys)
        if step % _REDUCE_EVERY == 0:
            np.remainder(ys, PRIME, out=ys)
    np.remainder(ys, PRIME, out=ys)
    return [int(y) for y in ys.tolist()]


def combine(shares: Sequence[Share], threshold: int) -> bytes:
    """The secret behind ``shares`` (Lagrange interpolation at 0).

    Raises:
        SecureAggregationError: fewer than ``threshold`` distinct shares.
    """
    return _combine_distinct({x % PRIME: y for x, y in shares}, threshold)


def combine_points(points: Mapping[int, int], threshold: int) -> bytes:
    """:func:`combine` of the shares ``points`` maps x to y for (what the aggregator
    gathers per sender: one y per holder), without copying them first when every x is
    already a field element's representative.

    Raises:
        SecureAggregationError: as :func:`combine`.
    """
    if points and min(points) > 0 and max(points) < PRIME:
        return _combine_distinct(points, threshold)
    return combine(list(points.items()), threshold)


def _combine_distinct(distinct: Mapping[int, int], threshold: int) -> bytes:
    ys = distinct.values()
    if 0 in distinct or (ys and (min(ys) < 0 or max(ys) >= PRIME)):
        raise SecureAggregationError("a share is not a point of the field (x = 0, or y too big)")
    if len(distinct) < threshold:
        raise SecureAggregationError(
            f"{len(distinct)} shares, {threshold} needed to recover a mask secret"
        )
    xs = sorted(distinct)[:threshold]
    weights = _lagrange_at_zero(tuple(xs))
    secret = sum(map(operator.mul, map(distinct.__getitem__, xs), weights)) % PRIME
    if secret >= 2 ** (8 * SECRET_BYTES):
        raise SecureAggregationError("shares do not combine to a valid secret")
    return secret.to_bytes(SECRET_BYTES, "big")


@functools.lru_cache(maxsize=16)
def _lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    """The Lagrange weights w_i with f(0) = sum(w_i * f(x_i)) mod PRIME, for distinct
    nonzero ``xs`` (field elements). They depend on the holders only, not on the secret:
    cached, so a round computes them once per set of answering holders, not once per
    secret (and the reveal's self-check reuses them)."""
    weights = []
    for i, xi in enumerate(xs):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if i != j:
                num = num * (-xj) % PRIME
                den = den * (xi - xj) % PRIME
        weights.append(num * pow(den, -1, PRIME) % PRIME)
    return tuple(weights)
