"""Checkpoints of the global state as safetensors bytes (never pickle).

A checkpoint holds the shared params θ_t and the outer optimizer's momentum, under
``params/<name>`` and ``momentum/<name>``, with the round and the hashes of both in
the safetensors metadata. Decoding recomputes the hashes, so a checkpoint whose tensors
were altered is refused even if its blob was re-addressed.

:func:`checkpoint_parts` gives the bytes of :func:`encode_checkpoint` as parts that view
the arrays (for :meth:`~lensemble_flwr.artifacts.store.Store.put_parts`, which streams
them to disk and hashes them as it writes): a commit never holds a model-sized copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from lensemble_flwr.artifacts.tensors import pack, pack_parts, unpack
from lensemble_flwr.canonical import digest_arrays
from lensemble_flwr.errors import CheckpointIntegrityError
from lensemble_flwr.params import NamedArrays

FORMAT = "lensemble-checkpoint/1"


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
    return pack(*_layout(round, params, momentum, params_hash=params_hash))


def checkpoint_parts(
    round: int,
    params: Mapping[str, np.ndarray],
    momentum: Mapping[str, np.ndarray],
    *,
    params_hash: str | None = None,
    momentum_hash: str | None = None,
) -> list[bytes | memoryview]:
    """The bytes of :func:`encode_checkpoint` (same arguments) as consecutive parts: the
    safetensors header, then views of the arrays' own buffers (no copy of a C-contiguous,
    little-endian array). ``b"".join(checkpoint_parts(...)) == encode_checkpoint(...)``.
    ``momentum_hash``, like ``params_hash``, may be passed when already computed (it
    must be ``digest_arrays(momentum, "momentum")``; decoding checks it)."""
    return pack_parts(
        *_layout(
            round, params, momentum, params_hash=params_hash, momentum_hash=momentum_hash
        )
    )


def _layout(
    round: int,
    params: Mapping[str, np.ndarray],
    momentum: Mapping[str, np.ndarray],
    *,
    params_hash: str | None,
    momentum_hash: str | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    tensors = {f"params/{n}": np.asarray(params[n], order="C") for n in sorted(params)}
    tensors |= {f"momentum/{n}": np.asarray(momentum[n], order="C") for n in sorted(momentum)}
    info = {
        "format": FORMAT,
        "round": round,
        "params_hash": params_hash or digest_arrays(params, "params"),
        "momentum_hash": momentum_hash or digest_arrays(momentum, "momentum"),
    }
    return tensors, info


def decode_checkpoint(data: bytes) -> Checkpoint:
    """Parse and check a checkpoint.

    Raises:
        CheckpointIntegrityError: not a lensemble checkpoint, or its params do not hash to
            the recorded params hash.
    """
    try:
        tensors, metadata = unpack(data)
    except ValueError as exc:
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
