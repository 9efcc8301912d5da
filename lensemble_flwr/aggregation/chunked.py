"""Run an element-wise kernel over large arrays in cache-sized chunks on a few threads.

numpy releases the GIL inside ufuncs, so splitting the index range of a large array
between threads uses every core; working chunk by chunk keeps the temporaries in
cache, so a kernel of several ufuncs reads its inputs from memory only once. Results
do not depend on the split: every kernel used with this is element-wise (or, for
checksums, combined with exact integer arithmetic).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

CHUNK = 1 << 16
"""Elements per chunk: a few float64 temporaries of this length fit in L2."""


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


_PARALLEL_MIN = 4 * CHUNK
_WORKERS = max(1, min(4, available_cores()))
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()

T = TypeVar("T")


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="lensemble-kernel")
        return _pool


def split(total: int) -> list[tuple[int, int]]:
    """Split ``range(total)`` into one contiguous, chunk-aligned range per worker."""
    if total < _PARALLEL_MIN or _WORKERS == 1:
        return [(0, total)]
    per = -(-total // _WORKERS)
    per = -(-per // CHUNK) * CHUNK
    return [(lo, min(lo + per, total)) for lo in range(0, total, per)]


def run_ranges(total: int, kernel: Callable[[int, int], T]) -> list[T]:
    """Call ``kernel(lo, hi)`` on each range of :func:`split(total) <split>`; results in
    range order. A kernel must only write to the ``[lo, hi)`` slice it is given."""
    ranges = split(total)
    if len(ranges) == 1:
        return [kernel(*ranges[0])]
    return list(_executor().map(lambda r: kernel(*r), ranges))
