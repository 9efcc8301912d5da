"""What the phase loop derived from who is reachable, remembered between its messages.

The blocking loop calls :meth:`Coordinator.invite` and :meth:`Coordinator.advance` after
every message, each with the transport's current peers. Deriving everything from scratch
each time — the peer set, who is still to be invited, who is ready, who is still to
deliver — costs O(C) per message, O(C^2) per round. A :class:`ReachMemo` remembers what
one attempt derived and reuses it while its inputs are provably the same:

* a peer list that is the *same tuple object* as before holds the same peers (a tuple
  cannot change; the in-process network returns one tuple until somebody comes or goes);
  a list, or a new tuple, is converted again;
* the attempt's participant sets only grow while it runs (the admission step adds, never
  removes; :meth:`Coordinator.rename`, which moves an invitation to another name, replaces
  the set instead). So the same set object with the same size holds the same members;
* an update admitted since the last look is found from the end of the attempt's
  ``update_digests`` (insertion-ordered, written with ``admitted``); when the two
  disagree in size, everything is derived again.

Whatever cannot be shown unchanged is recomputed exactly as before, so the results — and
every byte the round writes — are those of the plain computation.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Set

from lensemble_flwr.coordinator.attempt import Attempt


def _same(a: tuple[object, ...] | None, b: tuple[object, ...]) -> bool:
    """Element-wise identity (for objects) and equality (for counts) of two keys."""
    if a is None or len(a) != len(b):
        return False
    return all(
        x is y or (type(x) is int and type(y) is int and x == y)
        for x, y in zip(a, b, strict=True)
    )


class ReachMemo:
    """One coordinator's memory of what it derived from the reachable peers (see the
    module). It holds references to what its keys name, so no key outlives its object."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """Drop everything remembered. Called as an attempt begins: every key names its
        attempt, so none could match again, and a key would keep the previous attempt
        (its aggregator and model-sized sums) alive into the next."""
        self._peers: tuple[str, ...] | None = None
        self._peer_set: frozenset[str] = frozenset()
        self._sampled: tuple[object, ...] | None = None
        self._sampled_set: frozenset[str] = frozenset()
        self._idle_invite: tuple[object, ...] | None = None
        self._ready: tuple[object, ...] | None = None
        self._ready_set: set[str] = set()
        self._pending: tuple[object, ...] | None = None
        self._outstanding: set[str] = set()
        self._seen_admitted = 0

    def peer_set(self, reachable: Iterable[str]) -> frozenset[str]:
        """``reachable`` as a set; the set of the last call if it is the same tuple."""
        if type(reachable) is tuple:
            if reachable is not self._peers:
                self._peers, self._peer_set = reachable, frozenset(reachable)
            return self._peer_set
        return frozenset(reachable)

    def sampled(self, peers: frozenset[str], sample: frozenset[str]) -> frozenset[str]:
        """``peers & sample``; the last result when both are the same objects."""
        key = (peers, sample)
        if not _same(self._sampled, key):
            self._sampled, self._sampled_set = key, peers & sample
        return self._sampled_set

    # -- invite: a call that invited nobody invites nobody again on the same inputs -------
    def invite_key(self, attempt: Attempt, peers: Set[str]) -> tuple[object, ...]:
        """What a plaintext invitation round depends on: the attempt, its phase, the
        peers it may invite (after sampling) and who it invited already."""
        return (attempt, attempt.phase, peers, attempt.invited, len(attempt.invited))

    def invite_idle(self, key: tuple[object, ...]) -> bool:
        """Whether the last call with ``key`` invited nobody (so this one would not)."""
        return _same(self._idle_invite, key)

    def invited_nobody(self, key: tuple[object, ...]) -> None:
        """Remember that a call with ``key`` invited nobody and changed nothing."""
        self._idle_invite = key

    # -- advance -------------------------------------------------------------------------
    def ready(
        self,
        attempt: Attempt,
        peers: Set[str],
        bound: Collection[str] | None,
    ) -> set[str]:
        """The invited participants among ``peers`` (and in ``bound``, when it is given:
        the registry's bindings, a mapping that only grows); the caller must not modify
        the returned set."""
        key = (attempt, peers, attempt.invited, len(attempt.invited), bound, len(bound or ()))
        if not _same(self._ready, key):
            present = attempt.invited.intersection(peers)
            if bound is not None:
                present = {p for p in present if p in bound}
            self._ready, self._ready_set = key, present
        return self._ready_set

    def outstanding(self, attempt: Attempt, eligible: Set[str], peers: Set[str]) -> set[str]:
        """``(eligible & peers) - attempt.admitted - set(attempt.refused)``: who is still
        to deliver. Updated by the updates admitted since the last call when nothing else
        changed; the caller must not modify the returned set."""
        admitted, digests = attempt.admitted, attempt.update_digests
        key = (attempt, eligible, len(eligible), peers, attempt.refused, len(attempt.refused))
        grown = len(admitted) - self._seen_admitted
        if _same(self._pending, key) and len(digests) == len(admitted) and grown >= 0:
            newest = list(itertools.islice(reversed(digests), grown))
            if all(pid in admitted for pid in newest):
                self._outstanding.difference_update(newest)
                self._seen_admitted = len(admitted)
                return self._outstanding
        # in step with update_digests, or the next call cannot trust the difference
        self._pending = key if len(digests) == len(admitted) else None
        self._outstanding = set(eligible).intersection(peers) - admitted - set(attempt.refused)
        self._seen_admitted = len(admitted)
        return self._outstanding
