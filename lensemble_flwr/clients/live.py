"""Participants kept alive between the messages one ClientApp process handles.

A SuperNode may start a new process for every message, so a participant's state lives in
``context.state`` and a ClientApp can always rebuild it from there. A process that stays
(an actor of Flower's simulation engine, a long-lived ``flwr-clientapp``) would rebuild
the same participant for every message: the user's trainer, the Merkle root of its
dataset, the release pipeline, the optimizer. :class:`LiveParticipants` keeps the
participants a process built, each with the token its state was last saved under. When
``context.state`` still carries that token, the participant is handed back as it is. A
state saved by another process (on the simulation engine, another actor handled the
node's last message) or rolled back carries another token: the kept participant is then
handed back *stale*, and the ClientApp loads that state into it, which restores
everything its state covers (what a participant built afresh would load) and saves
building the trainer, the dataset commitment and the release pipeline again. A state
without a token (none saved yet, or written by hand) gets a participant built afresh.

The participants kept are bounded by their size (their saved state's arrays and their
model's parameters), least recently used first out. They are kept per process
(:func:`process_participants`), not per ClientApp object: Flower's simulation engine hands
its actors a new copy of the ClientApp with every message.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_KEEP_BYTES = 256 * 2**20
"""Bytes of participants a ClientApp process keeps alive by default (256 MiB)."""


def new_token() -> str:
    """A token naming one saved participant state (random: never reused)."""
    return secrets.token_hex(16)


def size_of(arrays: Mapping[str, np.ndarray], trainer: Any) -> int:
    """Bytes a kept participant holds, as far as it can be seen: its saved state's
    arrays (optimizer slots, local groups, release state) and its trainer's model's
    parameters and buffers."""
    size = sum(int(a.nbytes) for a in arrays.values())
    model = getattr(trainer, "model", None)
    state_dict = getattr(model, "state_dict", None)
    if callable(state_dict):
        size += sum(int(getattr(t, "nbytes", 0)) for t in state_dict().values())
    return size


@dataclass
class _Kept:
    token: str
    participant: Any
    size: int


class LiveParticipants:
    """At most ``capacity_bytes`` of participants, by key (run, node), with their tokens.

    Not thread-safe: one ClientApp process handles one message at a time.
    """

    def __init__(self, capacity_bytes: int = DEFAULT_KEEP_BYTES) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, not {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._kept: OrderedDict[Hashable, _Kept] = OrderedDict()
        self._bytes = 0  # the sum of the kept participants' sizes
        self.hits = 0  # handed back with the state it saved last
        self.stale = 0  # handed back to load another state
        self.misses = 0  # none kept, or no token to match

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def size(self) -> int:
        """Bytes currently kept."""
        return self._bytes

    def take(self, key: Hashable, token: str | None) -> Any | None:
        """The participant kept under ``key`` if its state was saved under ``token``, else
        None. Either way nothing stays under ``key``: a participant is handed out once and
        kept again (:meth:`keep`) only after its next state was saved, so one that failed
        half-way through a message is never reused."""
        participant, current = self.take_any(key, token)
        return participant if current else None

    def take_any(self, key: Hashable, token: str | None) -> tuple[Any | None, bool]:
        """The participant kept under ``key`` and whether its state is the one saved under
        ``token``: ``(p, True)`` as :meth:`take`; ``(p, False)`` when ``p``'s last state
        is another one, which the caller must load into ``p`` before using it (the
        state ``token`` names is newer or older than ``p``'s); ``(None, False)`` when
        nothing is kept under ``key`` or ``token`` is None (no saved state to load).
        Nothing stays under ``key``, as with :meth:`take`."""
        kept = self._kept.pop(key, None)
        if kept is not None:
            self._bytes -= kept.size
        if kept is None or token is None:
            self.misses += 1
            return None, False
        if kept.token == token:
            self.hits += 1
            return kept.participant, True
        self.stale += 1
        return kept.participant, False

    def keep(self, key: Hashable, token: str, participant: Any, size: int) -> None:
        """Keep ``participant``, whose state was just saved under ``token``; drop the least
        recently used ones beyond the capacity (a participant larger than the capacity is
        not kept)."""
        replaced = self._kept.pop(key, None)
        if replaced is not None:
            self._bytes -= replaced.size
        if size > self.capacity_bytes:
            return
        self._kept[key] = _Kept(token, participant, size)
        self._bytes += size
        while self._bytes > self.capacity_bytes:
            self._bytes -= self._kept.popitem(last=False)[1].size


_PROCESS: dict[int, LiveParticipants] = {}


def process_participants(capacity_bytes: int = DEFAULT_KEEP_BYTES) -> LiveParticipants:
    """This process's participants kept with ``capacity_bytes`` (one set per capacity)."""
    if capacity_bytes < 0:
        raise ValueError(f"capacity_bytes must be >= 0, not {capacity_bytes}")
    live = _PROCESS.get(capacity_bytes)
    if live is None:
        live = _PROCESS[capacity_bytes] = LiveParticipants(capacity_bytes)
    return live
