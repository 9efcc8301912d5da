"""A batch of collected payloads validated, and its updates' arrays hashed, on threads.

A feeder that hands the coordinator its replies all at once (Flower's ``aggregate_train``,
the shared-folder decider: :meth:`~.coordinator.Coordinator.conclude_collected`) would
otherwise validate and hash them one after the other, on one core: for large models the
hashing is most of the round (four 400 MB updates, 1.3 s of SHA-256 on this project's
machines). Validating a payload and hashing its arrays depend on nothing but the payload,
and both release the GIL where they are slow (numpy's reductions, hashlib), so they run
on as many threads as there are cores; admission, which checks and records each message
against the round, stays in order on the caller's thread and gets the results.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from lensemble_flwr.aggregation.chunked import available_cores
from lensemble_flwr.canonical import HASH_ON_A_THREAD_MIN_BYTES
from lensemble_flwr.protocol.messages import (
    ControlMessage,
    WirePayload,
    canonical_fields,
    from_wire,
)

__all__ = ["Prepared", "prepare_batch"]

PREPARE_ON_THREADS_MIN_BYTES = 8 * HASH_ON_A_THREAD_MIN_BYTES
"""A batch whose updates hold fewer array bytes is validated and hashed as it is admitted."""


@dataclasses.dataclass(frozen=True)
class Prepared:
    """One payload validated and its arrays hashed: the message and its canonical fields,
    or the error validating or hashing it raised (raised again where it is admitted)."""

    message: ControlMessage | None = None
    fields: dict[str, Any] | None = None
    error: Exception | None = None

    def result(self) -> tuple[ControlMessage, dict[str, Any]]:
        """The message and its fields, or raise the error."""
        if self.error is not None:
            raise self.error
        assert self.message is not None and self.fields is not None
        return self.message, self.fields


def prepare_batch(batch: list[WirePayload]) -> list[Prepared | None]:
    """Validate and hash every payload of ``batch`` on threads when its updates are
    large; one None per payload otherwise (each is then validated as it is admitted)."""
    threads = min(len(batch), available_cores())
    if threads < 2 or sum(_array_bytes(p) for p in batch) < PREPARE_ON_THREADS_MIN_BYTES:
        return [None] * len(batch)
    with ThreadPoolExecutor(threads, thread_name_prefix="lensemble-ingress") as pool:
        return list(pool.map(_prepare, batch))


def _prepare(payload: WirePayload) -> Prepared:
    try:
        message = from_wire(payload)
        return Prepared(message=message, fields=canonical_fields(message))
    except Exception as exc:  # the caller's admission raises it, and handles it as ever
        return Prepared(error=exc)


def _array_bytes(payload: Any) -> int:
    """Bytes of the arrays an update payload (or message) carries; 0 for anything else."""
    if isinstance(payload, Mapping):
        delta = payload.get("delta")
    else:
        delta = getattr(payload, "delta", None)
    if not isinstance(delta, Mapping):
        return 0
    return sum(a.nbytes for a in delta.values() if isinstance(a, np.ndarray))
