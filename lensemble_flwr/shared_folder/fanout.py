"""The decider's per-record work, one record per thread.

Once a sitting's decision is claimed, every record is read back from the store (its bytes
re-hashed against their digest), its signature checked (the body hashed again) and its
tensors decoded, record after record, before the coordinator admits any of them. None of
that depends on another record, and the slow parts (reading, SHA-256) release the GIL, so
a batch large enough to pay for the threads runs them on as many threads as there are
cores. Results come back in the order of the items, and the first error in that order is
raised, exactly as a loop would (the others' work is only reading and checking).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from lensemble_flwr.aggregation.chunked import available_cores
from lensemble_flwr.coordinator.batch import PREPARE_ON_THREADS_MIN_BYTES

__all__ = ["per_record"]

T = TypeVar("T")
R = TypeVar("R")


def per_record(work: Callable[[T], R], items: Sequence[T], *, nbytes: int | None) -> list[R]:
    """``[work(item) for item in items]``, on threads when there are several items and
    cores and the records hold ``nbytes`` >= :data:`PREPARE_ON_THREADS_MIN_BYTES` (the
    coordinator's own threshold for preparing a batch on threads); None: not known before
    the work is done (reading them), so threads whenever there are several.

    Raises:
        Exception: the first error ``work`` raised, in the order of ``items``.
    """
    threads = min(len(items), available_cores())
    if threads < 2 or (nbytes is not None and nbytes < PREPARE_ON_THREADS_MIN_BYTES):
        return [work(item) for item in items]
    with ThreadPoolExecutor(threads, thread_name_prefix="lensemble-folder") as pool:
        return list(pool.map(work, items))
