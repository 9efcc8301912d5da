"""A cryptographic PRG: the AES-256-CTR keystream as int64 words (arithmetic mod 2**64).

Not numpy's MT19937 or PCG64 (predictable from their output), and not a 32-bit seed:
the seed is a 32-byte AES-256 key, the output the CTR keystream from a zero counter
block (each key is used for one expansion only: keys are derived per round attempt and
per pair, so a counter block never repeats under a key). AES in counter mode is the PRG
Bonawitz et al. (CCS 2017) instantiate secure aggregation with; it replaced ChaCha20
here because, with the AES instructions x86-64 and ARMv8 CPUs have, OpenSSL expands it
2-3 times faster (measured on the 2-core benchmark machine: 3.8-5.6 against 1.6-2.4
GB/s), and a participant expands k + 1 model-sized keystreams every masked round.
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes

SEED_BYTES = 32
PRG_ID = "aes256-ctr"
"""The name a masked RoundOpen gives this PRG (``secagg_prg``): a participant refuses a
masked round under any other, since masks drawn with two PRGs do not cancel (the sum
would be noise, and nothing after the unmasking could tell)."""
_ZERO_COUNTER = bytes(16)


def keystream(seed: bytes) -> CipherContext:
    """The encryptor whose output on zero bytes is the keystream of ``seed`` (32 bytes)."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a PRG seed is {SEED_BYTES} bytes, got {len(seed)}")
    return Cipher(algorithms.AES(seed), modes.CTR(_ZERO_COUNTER)).encryptor()


def expand(seed: bytes, size: int) -> np.ndarray:
    """``size`` pseudorandom int64 words (uniform mod 2**64) from a 32-byte seed."""
    return np.frombuffer(keystream(seed).update(bytes(8 * size)), dtype="<i8").copy()


_CHUNK_WORDS = 1 << 15  # 256 KiB of keystream at a time, in one reused buffer


def add_streams(
    streams: list[tuple[bytes, int]], acc: np.ndarray, *, base: np.ndarray | None = None
) -> None:
    """``acc += sum(sign * expand(seed, acc.size))`` over ``streams`` (mod 2**64), in place;
    with ``base``, ``acc = base + ...`` instead (``acc``'s old contents are not read).

    Chunk-major: every stream's next 256 KiB is generated and added while that chunk of
    ``acc`` is in cache, so ``acc`` (and ``base``) cross memory once, however many streams
    there are. The words are exactly :func:`expand`'s.
    """
    if base is not None and (base.dtype != np.int64 or base.shape != acc.shape):
        raise ValueError("add_streams: base must be int64 with the accumulator's shape")
    if acc.dtype != np.int64 or not acc.flags.c_contiguous or acc.ndim != 1:
        raise ValueError("add_streams needs a contiguous 1-D int64 accumulator")
    encryptors = [
        (keystream(seed), np.add if sign > 0 else np.subtract) for seed, sign in streams
    ]
    zeros = bytes(8 * _CHUNK_WORDS)
    out = bytearray(8 * _CHUNK_WORDS + 64)  # update_into wants a little headroom
    words = np.frombuffer(out, dtype="<i8", count=_CHUNK_WORDS)
    for lo in range(0, acc.size, _CHUNK_WORDS):
        k = min(_CHUNK_WORDS, acc.size - lo)
        chunk = acc[lo : lo + k]
        if base is not None:
            np.copyto(chunk, base[lo : lo + k])
        for encryptor, combine in encryptors:
            encryptor.update_into(zeros[: 8 * k], out)
            combine(chunk, words[:k], out=chunk)
