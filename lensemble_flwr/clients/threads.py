"""torch's intra-op threads for a process whose machine several participants share.

torch starts one intra-op thread per core in every process. When several participants
train on one machine (the ClientApp actors of Flower's simulation engine, SuperNodes
started side by side, an in-process federation, a test session), their threads fight for
the same cores and a round can miss its deadlines: on 2 loaded cores ``./dev.sh main``
with torch's default did not finish in 230 s, and finished in 87 s with one thread each.
So these processes use one thread, unless the environment variable
``LENSEMBLE_TORCH_THREADS`` says otherwise: a positive number is the thread count, ``0``
leaves torch's default (for a participant that has the machine to itself).
"""

from __future__ import annotations

import os

from lensemble_flwr.errors import ConfigError

THREADS_ENV = "LENSEMBLE_TORCH_THREADS"
SHARED_MACHINE_THREADS = 1


def torch_threads(participants_here: int = 2) -> int | None:
    """The intra-op thread count for one of ``participants_here`` participants sharing
    this machine: ``LENSEMBLE_TORCH_THREADS`` if set (None for ``0``: torch's default),
    else one when they are several, None (torch's default) when it is alone.

    Raises:
        ConfigError: ``LENSEMBLE_TORCH_THREADS`` is not a whole number of at least 0, or
            ``participants_here`` is below 1.
    """
    if participants_here < 1:
        raise ConfigError("participants_here", f"must be at least 1, got {participants_here}")
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw:
        try:
            threads = int(raw)
        except ValueError:
            threads = -1
        if threads < 0:
            raise ConfigError(
                THREADS_ENV, f"{raw!r} is not a whole number of threads (0: torch's default)"
            )
        return threads or None
    return SHARED_MACHINE_THREADS if participants_here > 1 else None


def use_torch_threads(participants_here: int = 2) -> int:
    """Set torch's intra-op threads as :func:`torch_threads` says; returns the count
    torch uses afterwards. Nothing changes when it says torch's default.

    Raises:
        ConfigError: as :func:`torch_threads`, before anything is set.
    """
    threads = torch_threads(participants_here)
    import torch  # only where a participant trains: the coordinator needs no torch

    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
