"""The one canonical byte encoding behind every hash lensemble-flwr computes.

Encoding, version 1 (``ENCODING_VERSION``):

* A digest is ``SHA-256(b"lensemble-flwr/1/" + domain + b"\\x00" + body)`` written
  as 64 lower-case hex characters. The domain separates what is hashed (a leaf of a
  Merkle tree never collides with a node, a message never with a checkpoint).
* A JSON-like record is encoded as UTF-8 JSON with sorted keys, no whitespace,
  ASCII only, and no NaN or infinity.
* Named arrays are encoded as a header, the canonical JSON of
  ``[[name, dtype, shape], ...]`` in sorted name order with little-endian dtype
  strings (``"<f4"``), then its 8-byte big-endian length before it, then every
  array's raw little-endian C-order bytes in the same order.

Arrays are hashed without copying when they are already contiguous and little-endian.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

ENCODING_VERSION = 1
_PREFIX = b"lensemble-flwr/1/"

HASH_ON_A_THREAD_MIN_BYTES = 1 << 20
"""Below this many bytes, a hash that could overlap other work on a thread of its own is
computed on the calling thread instead: starting and joining a thread (0.1 ms on a quiet
core, several under load) costs more than SHA-256 of a megabyte saves. The digest is the
same either way."""


def canonical_json(value: Any) -> bytes:
    """Encode a JSON-compatible value canonically (sorted keys, no whitespace, ASCII)."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def _hasher(domain: str) -> hashlib._Hash:
    h = hashlib.sha256()
    h.update(_PREFIX + domain.encode("ascii") + b"\x00")
    return h


def digest_bytes(domain: str, data: bytes | memoryview) -> str:
    """SHA-256 of ``data`` under ``domain``."""
    h = _hasher(domain)
    h.update(data)
    return h.hexdigest()


def digest_record(domain: str, value: Any) -> str:
    """SHA-256 of the canonical JSON encoding of ``value`` under ``domain``."""
    return digest_bytes(domain, canonical_json(value))


def little_endian(array: np.ndarray) -> np.ndarray:
    """Return ``array`` as a C-contiguous little-endian array (a copy only if needed)."""
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return np.asarray(array, order="C")  # a 0-d array stays 0-d


def arrays_header(arrays: Mapping[str, np.ndarray]) -> list[list[Any]]:
    """The ``[[name, dtype, shape], ...]`` header of named arrays, in sorted name order."""
    return [
        [name, np.dtype(arrays[name].dtype).newbyteorder("<").str, list(arrays[name].shape)]
        for name in sorted(arrays)
    ]


def digest_arrays(arrays: Mapping[str, np.ndarray], domain: str = "arrays") -> str:
    """SHA-256 of named arrays in the canonical encoding (names, dtypes, shapes, bytes)."""
    h = _hasher(domain)
    header = canonical_json(arrays_header(arrays))
    h.update(len(header).to_bytes(8, "big"))
    h.update(header)
    for name in sorted(arrays):
        array = little_endian(arrays[name])
        if array.size:  # a zero-size array has no bytes (and memoryview.cast refuses it)
            h.update(memoryview(array).cast("B"))
    return h.hexdigest()


def derive_seed(root_seed: int, *labels: str | int) -> int:
    """Derive a reproducible 63-bit seed from the root seed and a path of labels.

    ``derive_seed(root, "round", 3)`` is the round seed s_3. Distinct label paths
    give independent seeds; the same path always gives the same seed.
    """
    d = digest_record("seed", [int(root_seed), *labels])
    return int(d[:16], 16) >> 1


def poisson_sample(items: Iterable[str], rate: float, seed: int, domain: str) -> list[str]:
    """Each of ``items`` kept independently with probability ``rate`` (sorted): an item is
    kept when the first 52 bits of the SHA-256 of ``(seed, item)`` under ``domain``, as a
    uniform in [0, 1), fall below ``rate``. Reproducible, and no one who fixed the seed
    beforehand can choose who is kept afterwards."""
    kept = [
        item for item in items if int(digest_record(domain, [seed, item])[:13], 16) < rate * 2**52
    ]
    return sorted(kept)


def seeded_sample(items: Iterable[str], count: int, seed: int, domain: str) -> list[str]:
    """``count`` of ``items``, the same for the same seed whatever the items' order: each
    item is ranked by the SHA-256 of ``(seed, item)`` under ``domain`` and the first
    ``count`` are kept (sorted). Uniform over the subsets of that size, and reproducible."""
    ranked = sorted(items, key=lambda item: (digest_record(domain, [seed, item]), item))
    return sorted(ranked[: max(0, count)])
