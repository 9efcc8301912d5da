"""Model-sized buffers reused from one round to the next: the int64 accumulators and the
round's outputs (the mean, θ' and m').

A fresh model-sized array is paid in page faults as it is first written: on the 2-core
benchmark machine, zeroing and adding into a fresh 200 MB array took 9 times as long as
into one already mapped (0.44 against 0.05 s). So :func:`output` keeps every model-sized
array it hands out, and hands it out again once nobody else refers to it.

A buffer is handed out only when nothing but this module refers to it
(``sys.getrefcount``, CPython's reference count, calibrated at import: recycling is off
where one more holder does not count as exactly one more, and on free-threaded builds): a
sum or a model somebody still holds (an attempt kept alive, a view of it, another
federation in the same process) is never overwritten; a fresh array is allocated instead.
Small arrays are not kept (allocating them is cheap).

The pool keeps a few generations per name: the coordinator still holds θ and m of the
last two rounds when it steps the next, so the buffer free for reuse is the one from three
rounds back (for a sum, the previous round's, let go as the next attempt begins). The peak
is unchanged (those buffers were allocated anew at the same point before); between
rounds, the freed buffers stay mapped instead of going back to the operating system.
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np

RECYCLE_MIN_BYTES = 1 << 20
"""Arrays smaller than this are allocated fresh every round."""
GENERATIONS = 4
"""Buffers kept per (name, shape, dtype): enough for θ and m of the last rounds, which
the coordinator still holds, plus the free one."""

_kept: dict[tuple[str, tuple[int, ...], str], list[np.ndarray]] = {}
_lock = threading.Lock()
_reused = 0


def _count(entries: list[np.ndarray], index: int) -> int:
    """The reference count of ``entries[index]``, always measured this way."""
    return sys.getrefcount(entries[index])


def _calibrate() -> int | None:
    """What :func:`_count` shows for a buffer nobody but the pool holds, or None
    (recycling off) if one more holder does not show as exactly one more: how an
    interpreter counts a value passed to ``getrefcount`` differs between versions
    (CPython 3.14 may borrow it), and a free-threaded build gives no reliable counts."""
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        return None
    unheld = _count([np.zeros(1)], 0)
    held = np.zeros(1)
    return unheld if _count([held], 0) == unheld + 1 else None


_UNHELD = _calibrate()
"""What :func:`_count` shows for a buffer only the pool holds; None: never reuse."""


def reused() -> int:
    """How many times this process has handed out a kept buffer."""
    return _reused


def output(name: str, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """A writable array of ``shape`` and ``dtype`` with undefined contents (every element
    must be written): one this function handed out before that nobody else refers to any
    more, or a fresh one. Either way it is kept for a later call, the oldest of the name's
    :data:`GENERATIONS` dropped."""
    global _reused
    dtype, shape = np.dtype(dtype), tuple(shape)
    if _UNHELD is None or math.prod(shape) * dtype.itemsize < RECYCLE_MIN_BYTES:
        return np.empty(shape, dtype)
    with _lock:
        entries = _kept.setdefault((name, shape, dtype.str), [])
        free = next((i for i in range(len(entries)) if _count(entries, i) == _UNHELD), None)
        if free is not None:
            found = entries.pop(free)
            found.setflags(write=True)
            _reused += 1
        else:
            found = np.empty(shape, dtype)
        entries.append(found)
        del entries[:-GENERATIONS]
    return found


def clear() -> None:
    """Drop every kept array (a strategy's run is over; tests)."""
    with _lock:
        _kept.clear()
