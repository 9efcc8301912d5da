"""Named arrays plus a JSON description, as safetensors bytes (never pickle).

Every lensemble artifact that carries arrays — a checkpoint, a shared-folder record, a
drill participant's saved state — is written by :func:`pack` and read by :func:`unpack`.
The description goes into the safetensors metadata as one entry, ``lensemble``, holding
canonical JSON: safetensors writes its metadata map in hash-map order, so several entries
would make the bytes (and so a blob's store address) vary from run to run, while one
entry makes them a deterministic function of the arrays and the description.
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

from lensemble_flwr.canonical import canonical_json

META_KEY = "lensemble"
"""The one safetensors metadata entry: the description, as canonical JSON."""


def pack(tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> bytes:
    """Safetensors bytes of ``tensors`` (C-contiguous arrays) described by ``meta`` (a
    JSON-able mapping); the same inputs always give the same bytes."""
    return st_save(dict(tensors), metadata={META_KEY: canonical_json(dict(meta)).decode("ascii")})


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
