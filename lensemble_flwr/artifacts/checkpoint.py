"""Checkpoints of the global state as safetensors bytes (never pickle).

A checkpoint holds the shared params θ_t and the outer optimizer's momentum, under
``params/<name>`` and ``momentum/<name>``, with the round and the hashes of both in
the safetensors metadata. Decoding recomputes the hashes, so a checkpoint whose tensors
were altered is refused even if its blob was re-addressed.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from lensemble_flwr.canonical import canonical_json, digest_arrays
from lensemble_flwr.errors import CheckpointIntegrityError
from lensemble_flwr.params import NamedArrays

FORMAT = "lensemble-checkpoint/1"
_META_KEY = "lensemble"


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The state a round starts from: θ_round and the momentum that produced it."""

    round: int
    params: NamedArrays
    momentum: NamedArrays
    params_hash: str


def encode_checkpoint(
    round: int,
    params: Mapping[str, np.ndarray],
    momentum: Mapping[str, np.ndarray],
    *,
    params_hash: str | None = None,
) -> bytes:
    """Serialize a checkpoint; the bytes are a deterministic function of the inputs.

    ``params_hash`` may be passed when the caller already computed it (it must be
    ``digest_arrays(params, "params")``; decoding checks it).
    """
    tensors = {f"params/{n}": np.ascontiguousarray(params[n]) for n in sorted(params)}
    tensors |= {f"momentum/{n}": np.ascontiguousarray(momentum[n]) for n in sorted(momentum)}
    info = {
        "format": FORMAT,
        "round": round,
        "params_hash": params_hash or digest_arrays(params, "params"),
        "momentum_hash": digest_arrays(momentum, "momentum"),
    }
    # safetensors writes its metadata map in hash-map order, so several keys would make
    # the bytes (and the blob address) vary from run to run; one key is deterministic.
    return st_save(tensors, metadata={_META_KEY: canonical_json(info).decode("ascii")})


def decode_checkpoint(data: bytes) -> Checkpoint:
    """Parse and check a checkpoint.

    Raises:
        CheckpointIntegrityError: not a lensemble checkpoint, or its params do not hash to
            the recorded params hash.
    """
    try:
        tensors = st_load(data)
        metadata = _metadata(data)
    except (SafetensorError, ValueError, KeyError, struct.error) as exc:
        raise CheckpointIntegrityError(f"unreadable checkpoint: {exc}") from None
    if metadata.get("format") != FORMAT:
        raise CheckpointIntegrityError(f"not a {FORMAT} checkpoint: {metadata.get('format')!r}")
    params = {k[len("params/") :]: v for k, v in tensors.items() if k.startswith("params/")}
    momentum = {k[len("momentum/") :]: v for k, v in tensors.items() if k.startswith("momentum/")}
    params = {n: params[n] for n in sorted(params)}
    actual = digest_arrays(params, "params")
    if actual != metadata.get("params_hash"):
        raise CheckpointIntegrityError(
            f"checkpoint params hash {actual[:12]}… differs from its recorded "
            f"{str(metadata.get('params_hash'))[:12]}…"
        )
    momentum = {n: momentum[n] for n in sorted(momentum)}
    if digest_arrays(momentum, "momentum") != metadata.get("momentum_hash"):
        raise CheckpointIntegrityError("checkpoint momentum does not match its recorded hash")
    return Checkpoint(
        round=int(metadata["round"]),
        params=params,
        momentum=momentum,
        params_hash=actual,
    )


def _metadata(data: bytes) -> dict[str, Any]:
    """The ``__metadata__`` of a safetensors buffer (8-byte length, then a JSON header)."""
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    info = json.loads(header.get("__metadata__", {}).get(_META_KEY, "{}"))
    if not isinstance(info, dict):
        raise ValueError("checkpoint metadata is not a mapping")
    return info
