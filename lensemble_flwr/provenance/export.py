"""A run's global model as a file a training script can load, checked against the ledger.

:func:`committed_model` verifies the run (the ledger chain, every kept checkpoint, the
manifest: :func:`~lensemble_flwr.provenance.verify.verify`), then reads the model that
round N left behind (the newest round by default): θ_N, the model round N+1 starts
from. That is the round's own checkpoint, or, when an external step replaced it before
the next round trained (the central noise of Flower's DP wrappers), the model the step
adopted, as for ``average`` (:mod:`.averaging`): under central DP the round's own
checkpoint is the un-noised sum, which is not what the run released. The blob is
re-hashed on read, the checkpoint's params are re-hashed, and that hash must be the one
the ledger (or the step) names.

:func:`encode_model` writes it as safetensors, never as a pickle: loading it runs no
code, and ``safetensors.torch.load_file`` gives a torch ``state_dict``. The file is a
function of the model alone (its header in name order): the same model exports to the
same bytes. The tensors carry the names
the app gave its arrays (a Flower ``ArrayRecord``'s keys, a torch ``state_dict``'s), as
the checkpoint stores them, with the same dtypes and bytes. What is not in a checkpoint
is not in the file: the arrays that never leave a node (local parameter groups) and the
non-floating arrays a Flower layer carries beside the model (BatchNorm's
``num_batches_tracked``), which keep the values the app started with.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Literal

import numpy as np

from lensemble_flwr.artifacts.checkpoint import decode_checkpoint
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.errors import ConfigError, LedgerError
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.provenance.ledger import RunManifest, is_pruned
from lensemble_flwr.provenance.retention import step_after
from lensemble_flwr.provenance.verify import verify

FORMAT = "lensemble-export/1"
Format = Literal["safetensors"]
FORMATS: tuple[Format, ...] = ("safetensors",)


@dataclasses.dataclass(frozen=True)
class CommittedModel:
    """The global model round ``round`` left, and where the ledger vouches for it."""

    run_id: str
    round: int
    params: NamedArrays  # by the app's names, sorted
    params_hash: str  # digest_arrays(params, "params"), as the ledger names it
    checkpoint: str  # the store digest of the checkpoint it was read from
    record_hash: str  # the ledger record of round ``round``
    external_step: bool  # an external step's adopted model, not the round's own

    def metadata(self) -> dict[str, str]:
        """What a safetensors export records beside the tensors (strings only)."""
        return {
            "format": FORMAT,
            "run_id": self.run_id,
            "round": str(self.round),
            "params_hash": self.params_hash,
            "checkpoint": self.checkpoint,
            "record_hash": self.record_hash,
            "model": "external-step" if self.external_step else "round",
        }


def committed_model(store: Store, round: int | None = None) -> CommittedModel:
    """The global model round ``round`` (default: the newest) left, verified.

    Raises:
        ConfigError: ``round`` is below 1.
        LedgerError: the run has no closed round, ``round`` was not committed, the run
            does not verify, or the model's checkpoint was pruned, is missing or holds
            other params than the hash the ledger names.
        CheckpointIntegrityError: the checkpoint blob does not hash to its address or
            does not decode.
    """
    if round is not None and round < 1:
        raise ConfigError("round", f"rounds are numbered from 1, got {round!r}")
    records = verify(store)
    if not records:
        raise LedgerError("the run has no closed round: there is no committed model to export")
    by_round = {r.round: r for r in records}
    wanted = records[-1].round if round is None else round
    if wanted not in by_round:
        raise LedgerError(
            f"round {wanted} was not committed (the ledger holds rounds "
            f"{records[0].round}-{records[-1].round})"
        )
    record = by_round[wanted]
    step = step_after(store, wanted, record.new_global_hash)
    digest, expected = (
        (step.checkpoint, step.adopted_hash)
        if step is not None
        else (record.checkpoint, record.new_global_hash)
    )
    if not store.has(digest):
        why = "was pruned (keep-last-checkpoints)" if is_pruned(store, digest) else "is missing"
        raise LedgerError(f"round {wanted}'s checkpoint {digest[:12]} {why}")
    checkpoint = decode_checkpoint(store.get(digest))  # the blob and the params re-hashed
    if checkpoint.params_hash != expected:
        raise LedgerError(
            f"round {wanted}'s checkpoint {digest[:12]} holds {checkpoint.params_hash[:12]}, "
            f"not the model {expected[:12]} the ledger names"
        )
    return CommittedModel(
        run_id=RunManifest.load(store).run_id,
        round=wanted,
        params=checkpoint.params,
        params_hash=checkpoint.params_hash,
        checkpoint=digest,
        record_hash=record.record_hash,
        external_step=step is not None,
    )


def encode_model(model: CommittedModel, format: Format = "safetensors") -> bytes:
    """The file's bytes: safetensors with :meth:`CommittedModel.metadata` (the one
    format: a torch ``state_dict`` saved with ``torch.save`` would be a pickle).

    Raises:
        ConfigError: ``format`` is not one of :data:`FORMATS`.
    """
    if format == "safetensors":
        from safetensors.numpy import save

        arrays = {n: np.asarray(a, order="C") for n, a in model.params.items()}  # 0-d stays
        return _in_name_order(save(arrays, metadata=model.metadata()))
    raise ConfigError("format", f"must be one of {', '.join(FORMATS)}, got {format!r}")


def _in_name_order(data: bytes) -> bytes:
    """Safetensors bytes with their header's entries (and the metadata's) in name order:
    safetensors writes its metadata in hash-map order, so the same model would make files
    of different bytes; this way one model makes one file (one SHA-256 to publish). The
    tensors' bytes and offsets are untouched (the offsets count from the data, which
    follows the header whatever its length)."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    meta = header.pop("__metadata__", {})
    ordered = {"__metadata__": dict(sorted(meta.items())), **dict(sorted(header.items()))}
    text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)  # safetensors pads its header to 8 bytes
    return struct.pack("<Q", len(text)) + text + data[8 + length :]
