"""Gaussian noise from a cryptographically secure source.

numpy's generators are fast but predictable: whoever sees enough outputs (or guesses a
seed) can subtract the noise, and then it protects nothing. Here the uniform bits come
from ChaCha20 keyed with 32 fresh bytes from the operating system (``os.urandom``), and
are turned into normals with the Box-Muller transform in float64. The noise is never
reproducible, by design: two runs with identical seeds release different noise.

(Floating-point Gaussian samples have known weaknesses — Mironov 2012 — that a discrete
Gaussian mechanism avoids; that is out of scope here and noted in docs/privacy.md.)
"""

from __future__ import annotations

import os

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

_TWO_52 = float(2**52)


def _keystream(nbytes: int) -> bytes:
    # The 16-byte ChaCha20 "nonce" here starts with the 32-bit block counter: a random one
    # can start within a few blocks of 2**32, and the stream then stops with a ValueError
    # (seen once in a 1,000-participant run). The key is fresh, so the counter starts at 0.
    key, nonce = os.urandom(32), bytes(4) + os.urandom(12)
    encryptor = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor()
    return encryptor.update(bytes(nbytes))


def secure_uniform(size: int) -> np.ndarray:
    """``size`` uniforms in (0, 1), float64, from a freshly keyed ChaCha20 stream."""
    words = np.frombuffer(_keystream(8 * size), dtype="<u8")
    # 52 random bits, shifted by half a step so that 0 and 1 are never produced (with 53,
    # the top value (2**53 - 1/2) / 2**53 would round to exactly 1.0)
    return ((words >> np.uint64(12)).astype(np.float64) + 0.5) / _TWO_52


def secure_normal(shape: tuple[int, ...], std: float) -> np.ndarray:
    """Normal noise with standard deviation ``std`` (float64), Box-Muller on CSPRNG bits."""
    n = int(np.prod(shape, dtype=np.int64))
    pairs = (n + 1) // 2
    u = secure_uniform(2 * pairs)
    radius = np.sqrt(-2.0 * np.log(u[:pairs]))
    angle = 2.0 * np.pi * u[pairs:]
    z = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:n]
    return (z * std).reshape(shape)
