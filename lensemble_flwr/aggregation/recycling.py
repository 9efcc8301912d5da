"""Model-sized buffers reused from one round to the next: the int64 accumulators and the
round's outputs (the mean, θ' and m').

A fresh ``np.zeros`` of a model-sized accumulator is paid in page faults as the fold
first writes each page: on the 2-core benchmark machine, zeroing and adding into a fresh
200 MB array took 9 times as long as into one already mapped (0.44 against 0.05 s). The
coordinator keeps the previous round's sum alive until the next attempt begins anyway,
so the next aggregator can take its buffers, zero them, and fold into them.

A buffer is handed out only when nothing but this module refers to it
(``sys.getrefcount``, CPython's reference count, calibrated at import: recycling is off
where one more holder does not count as exactly one more, and on free-threaded builds): a
sum somebody still holds (an attempt kept alive, a view of it, another federation in the
same process) is never overwritten; a fresh array is allocated instead. Small arrays are
not kept (allocating them is cheap).

The round's model-sized outputs (the mean, θ' and m') are recycled the same way, from a
pool that keeps a few generations per name (:func:`output`): the coordinator still holds
θ and m of the last two rounds when it steps the next, so the buffer free for reuse is
the one from three rounds back. The peak is unchanged (those buffers were allocated
anew at the same point before); between rounds, the freed outputs stay mapped instead
of going back to the operating system.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Mapping

import numpy as np

RECYCLE_MIN_BYTES = 1 << 20
"""Arrays smaller than this are allocated fresh every round."""

_kept: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}
_lock = threading.Lock()


def _take(key: tuple[str, tuple[int, ...]]) -> tuple[np.ndarray | None, int]:
    """The kept array under ``key`` (removed from the pool), with the reference count it
    shows here: counted in one place, so that :data:`_UNHELD` is measured the same way."""
    with _lock:
        found = _kept.pop(key, None)
    return found, (sys.getrefcount(found) if found is not None else 0)


def _calibrate() -> int | None:
    """The count :func:`_take` shows for an array nobody else holds, or None (recycling
    off) if one more holder does not show as exactly one more: how an interpreter counts
    a local passed to ``getrefcount`` differs between versions (CPython 3.14 may borrow
    it), and a free-threaded build does not give reliable counts at all."""
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        return None
    probe = ("lensemble-calibration", (1,))
    with _lock:
        _kept[probe] = np.zeros(1, np.int64)
    _, unheld = _take(probe)
    held = np.zeros(1, np.int64)
    with _lock:
        _kept[probe] = held
    _, once_held = _take(probe)
    return unheld if once_held == unheld + 1 else None


_UNHELD = _calibrate()
"""What :func:`_take` counts for an array only the pool held; None: never reuse."""

OUTPUT_GENERATIONS = 4
"""Outputs kept per (name, shape, dtype): enough for θ and m of the last rounds, which
the coordinator still holds, plus the free one."""
_outputs: dict[tuple[str, tuple[int, ...], str], list[np.ndarray]] = {}


def _count(entries: list[np.ndarray], index: int) -> int:
    """The reference count of ``entries[index]``, always measured this way."""
    return sys.getrefcount(entries[index])


def _calibrate_outputs() -> int | None:
    """What :func:`_count` shows for an output nobody but the pool holds, or None."""
    if _UNHELD is None:
        return None
    unheld = _count([np.zeros(1)], 0)
    held = np.zeros(1)
    return unheld if _count([held], 0) == unheld + 1 else None


_OUTPUT_UNHELD = _calibrate_outputs()
_reused = [0]


def outputs_reused() -> int:
    """How many times :func:`output` has handed out a kept buffer in this process."""
    return _reused[0]


def output(name: str, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """A writable array of ``shape`` and ``dtype`` with undefined contents (every element
    must be written): one this function handed out before that nobody else refers to any
    more, or a fresh one. Either way it is kept for a later call, the oldest of the name's
    :data:`OUTPUT_GENERATIONS` dropped."""
    dtype = np.dtype(dtype)
    shape = tuple(shape)
    if _OUTPUT_UNHELD is None or math.prod(shape) * dtype.itemsize < RECYCLE_MIN_BYTES:
        return np.empty(shape, dtype)
    with _lock:
        entries = _outputs.setdefault((name, shape, dtype.str), [])
        free = next((i for i in range(len(entries)) if _count(entries, i) == _OUTPUT_UNHELD), None)
        if free is not None:
            found = entries.pop(free)
            found.setflags(write=True)
            _reused[0] += 1
        else:
            found = np.empty(shape, dtype)
        entries.append(found)
        del entries[:-OUTPUT_GENERATIONS]
    return found


def keep(sums: Mapping[str, np.ndarray]) -> None:
    """Offer the int64 arrays :func:`zeroed` gave an aggregator, once they hold a revealed
    sum, for reuse by the next accumulator of the same names and shapes (replacing any
    offered before)."""
    if _UNHELD is None:
        return
    with _lock:
        for name, array in sums.items():
            if array.nbytes >= RECYCLE_MIN_BYTES:
                _kept[(name, array.shape)] = array


def zeroed(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A writable int64 array of ``shape``, all zeros: a kept one nobody else refers to,
    or a fresh one. Either way the kept entry for (``name``, ``shape``) is dropped."""
    found, refs = _take((name, tuple(shape)))
    if found is not None and refs == _UNHELD:
        found.setflags(write=True)
        found.fill(0)
        return found
    return np.zeros(shape, np.int64)


def clear() -> None:
    """Drop every kept array (a strategy's run is over; tests)."""
    with _lock:
        _kept.clear()
        _outputs.clear()
