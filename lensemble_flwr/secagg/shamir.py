"""Shamir secret sharing of 32-byte secrets over the prime field GF(2**521 - 1).

A secret is split into n shares so that any ``threshold`` of them recover it and fewer
reveal nothing. Shares are (x, y) with x = 1..n; coefficients come from ``secrets``.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

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
    shares = []
    for x in range(1, count + 1):
        y = 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % PRIME
        shares.append((x, y))
    return shares


def combine(shares: Sequence[Share], threshold: int) -> bytes:
    """The secret behind ``shares`` (Lagrange interpolation at 0).

    Raises:
        SecureAggregationError: fewer than ``threshold`` distinct shares.
    """
    distinct = {x % PRIME: y for x, y in shares}
    if 0 in distinct or any(not 0 <= y < PRIME for y in distinct.values()):
        raise SecureAggregationError("a share is not a point of the field (x = 0, or y too big)")
    if len(distinct) < threshold:
        raise SecureAggregationError(
            f"{len(distinct)} shares, {threshold} needed to recover a mask secret"
        )
    points = sorted(distinct.items())[:threshold]
    secret = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                num = num * (-xj) % PRIME
                den = den * (xi - xj) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
    if secret >= 2 ** (8 * SECRET_BYTES):
        raise SecureAggregationError("shares do not combine to a valid secret")
    return secret.to_bytes(SECRET_BYTES, "big")
