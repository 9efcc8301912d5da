"""A cryptographic PRG: ChaCha20 keystream as int64 words (arithmetic mod 2**64).

Not numpy's MT19937 or PCG64 (predictable from their output), and not a 32-bit seed:
the seed is a 32-byte key, the output the ChaCha20 keystream under a zero nonce (each
key is used for one expansion only: keys are derived per round and per pair).
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

SEED_BYTES = 32


def expand(seed: bytes, size: int) -> np.ndarray:
    """``size`` pseudorandom int64 words (uniform mod 2**64) from a 32-byte seed."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a PRG seed is {SEED_BYTES} bytes, got {len(seed)}")
    encryptor = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()
    return np.frombuffer(encryptor.update(bytes(8 * size)), dtype="<i8").copy()
