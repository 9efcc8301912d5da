"""Named arrays plus a JSON description, as safetensors bytes (never pickle).

Every lensemble artifact that carries arrays — a checkpoint, a shared-folder record, a
drill participant's saved state — is written by :func:`pack` and read by :func:`unpack`.
The description goes into the safetensors metadata as one entry, ``lensemble``, holding
canonical JSON: safetensors writes its metadata map in hash-map order, so several entries
would make the bytes (and so a blob's store address) vary from run to run, while one
entry makes them a deterministic function of the arrays and the description.

:func:`pack_parts` gives the same bytes as :func:`pack` without assembling them: the
safetensors header, then a view of each array's own buffer, for a writer that streams a
large model to a file (and hashes it as it goes) without another copy in memory.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from lensemble_flwr.canonical import canonical_json, little_endian

META_KEY = "lensemble"
"""The one safetensors metadata entry: the description, as canonical JSON."""


def pack(tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> bytes:
    """Safetensors bytes of ``tensors`` (C-contiguous arrays) described by ``meta`` (a
    JSON-able mapping); the same inputs always give the same bytes."""
    return st_save(dict(tensors), metadata={META_KEY: canonical_json(dict(meta)).decode("ascii")})


_DTYPE_CODES = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
}
"""The dtypes :func:`pack_parts` lays out itself (a checkpoint's), with their safetensors
codes; safetensors orders them F64, F32, F16. Arrays of any other dtype are left to
:func:`pack`."""


def pack_parts(
    tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any]
) -> list[bytes | memoryview]:
    """The bytes of :func:`pack` as consecutive parts: the safetensors header, then a
    byte view of each array in the order safetensors lays them out (float64, float32,
    float16, then by name). Arrays are viewed, not copied, when they are
    C-contiguous and little-endian; ``b"".join(parts) == pack(tensors, meta)``.

    Safetensors' own layout, re-stated: an 8-byte little-endian header length, then the
    header, compact JSON with ``__metadata__`` first and each tensor's dtype, shape and
    ``[begin, end)`` data offsets, padded with spaces to a multiple of 8 bytes.
    """
    arrays = {}
    for name, array in tensors.items():
        if np.dtype(array.dtype).newbyteorder("=") not in _DTYPE_CODES:
            return [pack(tensors, meta)]  # a dtype laid out by safetensors itself
        array = np.asarray(array)
        arrays[name] = little_endian(array).reshape(array.shape)  # 0-d stays 0-d
    order = sorted(arrays, key=lambda n: (-arrays[n].dtype.itemsize, n))  # F64, F32, F16
    header: dict[str, Any] = {
        "__metadata__": {META_KEY: canonical_json(dict(meta)).decode("ascii")}
    }
    offset = 0
    for name in order:
        array = arrays[name]
        end = offset + array.nbytes
        header[name] = {
            "dtype": _DTYPE_CODES[array.dtype.newbyteorder("=")],
            "shape": list(array.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    parts: list[bytes | memoryview] = [struct.pack("<Q", len(text)) + text]
    parts += [memoryview(arrays[n]).cast("B") for n in order if arrays[n].size]
    return parts


def unpack(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays and the description that :func:`pack` wrote.

    Raises:
        ValueError: ``data`` is not safetensors bytes, or has no JSON object under
            :data:`META_KEY` in its metadata.
    """
    try:
        tensors = st_load(data)
        # safetensors bytes: an 8-byte little-endian header length, then a JSON header
        (length,) = struct.unpack("<Q", data[:8])
        meta = json.loads(json.loads(data[8 : 8 + length])["__metadata__"][META_KEY])
    except (SafetensorError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise ValueError(f"not lensemble safetensors bytes: {str(exc)[:200]}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"the {META_KEY!r} metadata is not a JSON object")
    return tensors, meta
