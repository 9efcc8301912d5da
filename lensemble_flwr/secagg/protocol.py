"""The participant's and the aggregator's roles in a secure sum (Bonawitz et al. style).

Values are int64 vectors added mod 2**64 — the fixed-point integers of the plaintext
accumulator, so a revealed sum is bitwise the plaintext sum. Participant u sends

    y_u = q_u + PRG(b_u) + sum_{v > u} PRG(s_uv) - sum_{v < u} PRG(s_uv)      (mod 2**64)

where b_u is a fresh self-mask seed and s_uv = HKDF(X25519(u, v), context) the pairwise
seed of the round attempt; pairwise masks cancel in the sum of all members. Every mask
key pair is used for one round attempt only: a member announces the key of its next round
with this round's update. Along with y_u it sends, sealed for each member v (each
neighbour, in a sparse graph: below), a Shamir share of b_u. To reveal, each surviving
member discloses, for every sender, exactly one thing: the b-share if the sender's
masked input was received; its own pairwise seed with the sender, *for this context
only*, if it was not. The aggregator then removes the self
masks of the survivors and the dangling pairwise masks of the dropped members. No private
key is ever reconstructed, so nothing disclosed in one round says anything about another.

The price of disclosing seeds instead of reconstructing the dropped member's key: every
survivor with a dropped neighbour must answer the unmask request (its seed with that
neighbour is known to the two of them only); if one does not, the sum cannot be revealed
and the attempt is retried. Self masks still need only ``threshold`` answers.

With ``degree`` = k > 0 (SecAgg+-style, Bell et al. 2020) a member exchanges pairwise
masks only with its k neighbours in a ring of the members ordered by a hash of the round
attempt's context — a fresh order every attempt, which nobody chooses — instead of with
every other member. When that graph is sparse (0 < k < C - 1) the self mask follows it:
a member deals its Shamir shares of b_u to its k neighbours only, any
:func:`share_threshold` t_k = ceil(k t / C) of which recover it, and a survivor discloses
shares for its neighbours only; per member, the traffic and the work are O(k), not O(C).
The threshold t keeps its other meaning: no sum of fewer than t survivors is revealed. A
survivor's input stays hidden in the sum as long as one of its neighbours survives too,
and its self mask needs t_k of them: the aggregator refuses (before it asks anyone to
disclose), and every member refuses to disclose, when a survivor would be left with fewer,
or when the survivors would fall into unconnected groups (whose sums the coordinator could
reveal one by one: :meth:`NeighbourGraph.groups`). The price is collusion resistance: a
survivor's b is recoverable by a coordinator colluding with t_k of its neighbours (its
input, with all its surviving neighbours), instead of with t members. With the full graph
(k = 0 or k >= C - 1) every member holds a share of every self mask, threshold t, as above.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import os
from collections.abc import Mapping, Sequence

import numpy as np

from lensemble_flwr.errors import SecureAggregationError
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.secagg import prg, shamir
from lensemble_flwr.secagg.keys import SecAggKeys, open_in, seal_in


@dataclasses.dataclass(frozen=True)
class Disclosure:
    """One survivor's answer to the unmask request.

    Attributes:
        self_mask: survivor -> this holder's Shamir share of its self-mask seed.
        pair_seeds: dropped neighbour -> this holder's pairwise seed with it (this round
            attempt's context only).
    """

    self_mask: dict[str, shamir.Share]
    pair_seeds: dict[str, bytes]


@dataclasses.dataclass(frozen=True)
class Member:
    """A participant of a masked round, as everybody knows it: its id and public keys."""

    pid: str
    mask_public: bytes
    enc_public: bytes


def context_of(run_id: str, round: int, attempt: int) -> bytes:
    """What every seed and sealed share of one round attempt is bound to."""
    return f"{run_id}|{round}|{attempt}".encode()


def _flatten(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(arrays[n], np.int64).reshape(-1) for n in sorted(arrays)])


def _unflatten(flat: np.ndarray, template: Mapping[str, np.ndarray]) -> NamedArrays:
    out, offset = {}, 0
    for name in sorted(template):
        size = int(np.prod(template[name].shape, dtype=np.int64))
        out[name] = flat[offset : offset + size].reshape(template[name].shape)
        offset += size
    return out


def _aad(context: bytes, sender: str, holder: str) -> bytes:
    return b"|".join((context, sender.encode(), holder.encode()))


def _ordered(members: Sequence[Member]) -> list[Member]:
    ordered = sorted(members, key=lambda m: m.pid)
    if len({m.pid for m in ordered}) != len(ordered):
        raise SecureAggregationError("duplicate member ids")
    return ordered


@dataclasses.dataclass(frozen=True)
class MaskedRelease:
    """What :func:`mask` returns: the masked values and the self-mask shares, sealed."""

    masked: NamedArrays
    sealed: dict[str, bytes]  # holder -> this round's self-mask share, sealed for it


class NeighbourGraph:
    """The neighbour graph of one round attempt, built once: the ring is hashed and sorted
    once (C SHA-256), each member's neighbours are read off it (``degree`` ring steps),
    and :meth:`isolated` checks a survivor set in O(C k). :func:`graph_of` caches it per
    (member ids, degree, context), so every call of a round shares one."""

    def __init__(self, pids: Sequence[str], degree: int, context: bytes) -> None:
        self.pids = tuple(pids)
        self.degree = degree
        self._sorted = sorted(self.pids)
        self._count = collections.Counter(self.pids)
        self._near: dict[str, frozenset[str]] = {}
        self._ring: list[str] = []
        self._at: dict[str, int] = {}
        if degree > 0:
            self._ring = sorted(
                self.pids,
                key=lambda pid: hashlib.sha256(context + b"|ring|" + pid.encode()).digest(),
            )
            for at, pid in enumerate(self._ring):
                self._at.setdefault(pid, at)  # the first place, as list.index finds it

    def _sparse_for(self, me: str) -> bool:
        others = len(self.pids) - self._count.get(me, 0)
        return 0 < self.degree < others

    @property
    def sparse(self) -> bool:
        """Whether the members' graph is sparse (0 < ``degree`` < C - 1): then every
        member deals its self-mask shares to its neighbours only (:func:`holders`)."""
        return 0 < self.degree < len(self._count) - 1

    def near(self, me: str) -> frozenset[str]:
        """``me``'s neighbours, as a set (see :func:`neighbours`).

        Raises:
            ValueError: the graph is sparse and ``me`` is not a member.
        """
        if not self._sparse_for(me):  # every other member (not kept: C of them)
            return frozenset(p for p in self.pids if p != me)
        found = self._near.get(me)
        if found is None:
            if me not in self._at:
                raise ValueError(f"{me!r} is not in the ring")
            at, half, size = self._at[me], self.degree // 2, len(self._ring)
            found = frozenset(
                self._ring[(at + step) % size] for step in range(-half, half + 1) if step != 0
            )
            self._near[me] = found
        return found

    def neighbours(self, me: str) -> list[str]:
        """``me``'s neighbours, sorted (see :func:`neighbours`)."""
        if not self._sparse_for(me):
            return [p for p in self._sorted if p != me]
        return sorted(self.near(me))

    def isolated(self, survivors: Sequence[str]) -> list[str]:
        """The survivors none of whose neighbours survived, sorted (see
        :func:`isolated_survivors`); none with the full graph."""
        if self.degree <= 0:
            return []
        if self.sparse:
            return self.short_of(survivors, 1)
        alive = set(survivors)
        return sorted(s for s in alive if alive.isdisjoint(self.near(s)))

    def short_of(self, survivors: Sequence[str], need: int) -> list[str]:
        """The survivors with fewer than ``need`` surviving neighbours, sorted; none with
        the full graph. Counted from the dropped side: every survivor has ``degree``
        neighbours (the ring has more than ``degree`` + 1 places), so only those next to
        a dropped member can fall short: O(C + dropped x k), not O(C k)."""
        if not self.sparse:
            return []
        alive = set(survivors)
        if need > self.degree:  # nobody has that many neighbours
            return sorted(alive)
        lost: collections.Counter[str] = collections.Counter()
        for pid in self._ring:
            if pid not in alive:
                lost.update(alive.intersection(self.near(pid)))
        return sorted(s for s, n in lost.items() if self.degree - n < need)

    def groups(self, survivors: Sequence[str]) -> int:
        """Into how many groups the survivors fall when only survivor-to-survivor edges
        count (1 for a connected set; 0 for none). In a sparse graph two survivors next
        to each other in the ring with ``degree // 2`` or more dropped members between
        them are not neighbours, nor is anyone across that gap; on the ring, b such gaps
        make b groups. The coordinator can reveal each group's sum on its own (the masks
        of a group cancel up to the seeds with dropped members, which are disclosed), so
        a sum is revealable only when the survivors are one group. O(C); 1 with the full
        graph (every survivor is every other's neighbour)."""
        alive = set(survivors)
        if not alive:
            return 0
        if not self.sparse:
            return 1
        places = [at for at, pid in enumerate(self._ring) if pid in alive]
        half, size = self.degree // 2, len(self._ring)
        gaps = sum(
            1
            for at, nxt in zip(places, places[1:] + places[:1], strict=True)
            if (nxt - at - 1) % size >= half
        )
        return max(1, gaps) if len(places) > 1 else 1

    def holders(self, sender: str) -> list[str]:
        """Who holds a share of ``sender``'s self mask, in the order of their points x =
        1, 2, ...: its neighbours (sorted) in a sparse graph, every member otherwise."""
        if self.sparse:
            return self.neighbours(sender)
        return list(self._sorted)


@functools.lru_cache(maxsize=32)
def _graph(pids: tuple[str, ...], degree: int, context: bytes) -> NeighbourGraph:
    return NeighbourGraph(pids, degree, context)


def graph_of(members: Sequence[Member], degree: int, context: bytes) -> NeighbourGraph:
    """The round attempt's neighbour graph over ``members`` (built once, then cached)."""
    return _graph(tuple(m.pid for m in members), degree, context)


def neighbours(me: str, members: Sequence[Member], degree: int, context: bytes) -> list[str]:
    """The members ``me`` exchanges pairwise masks with, sorted: every other member when
    ``degree`` is 0 or reaches them all; otherwise the ``degree // 2`` members on either
    side of ``me`` in the ring ordered by SHA-256(context, pid). The relation is
    symmetric: u is v's neighbour exactly when v is u's."""
    return graph_of(members, degree, context).neighbours(me)


def isolated_survivors(
    members: Sequence[Member], survivors: Sequence[str], degree: int, context: bytes
) -> list[str]:
    """In a sparse graph (``degree`` > 0), the survivors none of whose neighbours survived:
    revealing the sum would expose their input (their only remaining mask is their self
    mask, which the reveal removes). With the full graph the threshold and the quorum
    govern how few survivors a sum may have, as before."""
    if degree <= 0:
        return []
    return graph_of(members, degree, context).isolated(survivors)


def share_threshold(member_count: int, degree: int, threshold: int) -> int:
    """How many shares recover a member's self mask: ``threshold`` (t) with the full
    graph, where every member holds one; in a sparse graph, where only the ``degree`` = k
    neighbours do, t_k = ceil(k * t / C) clipped to [1, k], so that the share of a
    member's holders that must answer, t_k / k, is the share of all members that must
    survive, t / C. Everyone computes it from what the round announces (C, k, t)."""
    if not 0 < degree < member_count - 1:
        return threshold
    return min(degree, max(1, -(-degree * threshold // member_count)))


def short_of_shares(
    members: Sequence[Member], survivors: Sequence[str], degree: int, threshold: int,
    context: bytes,
) -> list[str]:  # fmt: skip
    """In a sparse graph, the survivors whose self mask cannot be removed: fewer than
    :func:`share_threshold` of their neighbours (its holders) survived to disclose a
    share of it (this covers the isolated ones). None with the full graph."""
    graph = graph_of(members, degree, context)
    if not graph.sparse:
        return []
    return graph.short_of(survivors, share_threshold(len(members), degree, threshold))


def _seal_shares(
    secret: bytes,
    keys: SecAggKeys,
    me: str,
    holders: Sequence[Member],
    threshold: int,
    aad: bytes,
) -> dict[str, bytes]:
    """One Shamir share of ``secret`` for each of ``holders`` (the i-th gets x = i + 1),
    sealed for it."""
    shares = shamir.split(secret, threshold, len(holders))
    return {
        holder.pid: seal_in(
            keys.box(holder.enc_public), f"{x}:{y:x}".encode(), _aad(aad, me, holder.pid)
        )
        for holder, (x, y) in zip(holders, shares, strict=True)
    }


def mask(
    values: Mapping[str, np.ndarray],
    *,
    me: str,
    keys: SecAggKeys,
    members: Sequence[Member],
    threshold: int,
    context: bytes,
    degree: int = 0,
) -> MaskedRelease:
    """Mask ``values`` (int64) for the round and seal shares of its fresh self mask.
    ``degree``: pairwise masks with that many neighbours (0: with every other member)."""
    ordered = _ordered(members)
    if me not in {m.pid for m in ordered}:
        raise SecureAggregationError(f"{me} is not a member of this masked round")
    graph = graph_of(ordered, degree, context)
    near = graph.near(me)
    names = sorted(values)
    if len(names) == 1:  # one array: read it where it is (a view, not a copy)
        base = np.asarray(values[names[0]], np.int64).reshape(-1)
    else:
        base = _flatten(values)
    masked = np.empty(base.size, np.int64)  # fresh: the values are not modified
    self_seed = os.urandom(prg.SEED_BYTES)
    streams = [(self_seed, +1)] + [
        (keys.pair_seed(peer.mask_public, context), +1 if me < peer.pid else -1)
        for peer in ordered
        if peer.pid in near
    ]
    prg.add_streams(streams, masked, base=base)
    if graph.sparse:  # SecAgg+: the self mask is shared among the neighbours only
        holders = [m for m in ordered if m.pid in near]
        threshold = share_threshold(len(ordered), degree, threshold)
    else:
        holders = ordered
    sealed = _seal_shares(self_seed, keys, me, holders, threshold, context)
    return MaskedRelease(masked=_unflatten(masked, values), sealed=sealed)


def _open_share(
    keys: SecAggKeys, sender: Member, me: str, sealed: bytes, aad: bytes
) -> shamir.Share:
    plain = open_in(keys.box(sender.enc_public), sealed, _aad(aad, sender.pid, me))
    try:
        x, y = plain.decode("ascii").split(":")
        return (int(x), int(y, 16))
    except (ValueError, UnicodeDecodeError):
        raise SecureAggregationError(f"{sender.pid}'s sealed share is not a share") from None


def check_partition(
    *,
    me: str,
    members: Sequence[Member],
    context: bytes,
    survivors: Sequence[str],
    dropped: Sequence[str],
    threshold: int,
    degree: int = 0,
) -> None:
    """Everything a member checks of a survivor set before it attests it or discloses
    for it (the partition itself; whether the coordinator may ask is checked by the
    caller).

    Raises:
        SecureAggregationError: a sender is named both survivor and dropped (disclosing
            both would unmask its individual input), the survivors and the dropped are
            not the members, each named once, ``me`` is not a survivor, there are fewer
            survivors than the threshold t (on every graph: a sum of fewer than t
            members is never revealed), a survivor would be left with no surviving
            neighbour or, in a sparse graph, with fewer than t_k, or the survivors fall
            into unconnected groups.
    """
    both = set(survivors) & set(dropped)
    if both:
        raise SecureAggregationError(f"refusing to disclose both shares of {sorted(both)}")
    ids = {m.pid for m in members}
    named = [*survivors, *dropped]
    if set(named) != ids or len(named) != len(ids):
        raise SecureAggregationError(
            "refusing to disclose: the survivors and the dropped are not the members"
        )
    if me not in survivors:
        raise SecureAggregationError(f"refusing to disclose: {me} is not named a survivor")
    if len(survivors) < threshold:
        raise SecureAggregationError(
            f"refusing to disclose: {len(survivors)} survivors, threshold {threshold}"
        )
    alone = isolated_survivors(members, survivors, degree, context)
    if alone:
        raise SecureAggregationError(
            f"refusing to disclose: {alone} would have no surviving neighbour"
        )
    graph = graph_of(members, degree, context)
    if not graph.sparse:
        return
    if graph.groups(survivors) > 1:
        raise SecureAggregationError(
            "refusing to disclose: the survivors fall into unconnected groups, whose "
            "sums could be revealed one by one"
        )
    short = short_of_shares(members, survivors, degree, threshold, context)
    if short:
        need = share_threshold(len(members), degree, threshold)
        raise SecureAggregationError(
            f"refusing to disclose: {short} would have fewer than {need} surviving "
            "neighbours to disclose their self mask"
        )


def disclose(
    *,
    me: str,
    keys: SecAggKeys,
    members: Sequence[Member],
    context: bytes,
    survivors: Sequence[str],
    dropped: Sequence[str],
    self_mask_shares: Mapping[str, bytes],
    threshold: int,
    degree: int = 0,
) -> Disclosure:
    """A member's answer to the unmask request: for each sender one thing, never two.

    Args:
        keys: this round attempt's mask key and the member's sealing key.
        self_mask_shares: survivor -> its self-mask share sealed for me (this round); in a
            sparse graph only my neighbours dealt me one.
        threshold: the round's threshold t (in a sparse graph, every survivor must keep
            :func:`share_threshold` surviving neighbours).

    Raises:
        SecureAggregationError: what :func:`check_partition` refuses (among others, fewer
            survivors than t), a share comes from a member that is not my neighbour, or
            a sealed share does not authenticate.
    """
    check_partition(
        me=me, members=members, context=context, survivors=survivors, dropped=dropped,
        threshold=threshold, degree=degree,
    )  # fmt: skip
    graph = graph_of(members, degree, context)
    near = graph.near(me)
    if graph.sparse:
        strangers = sorted(set(self_mask_shares) - near)
        if strangers:
            raise SecureAggregationError(
                f"refusing to disclose: shares from {strangers}, who are not my neighbours"
            )
    by_id = {m.pid: m for m in members}
    self_mask = {
        sender: _open_share(keys, by_id[sender], me, self_mask_shares[sender], context)
        for sender in survivors
        if sender in self_mask_shares
    }
    pair_seeds = {
        peer: keys.pair_seed(by_id[peer].mask_public, context) for peer in dropped if peer in near
    }
    return Disclosure(self_mask=self_mask, pair_seeds=pair_seeds)


class MaskedSum:
    """The aggregator's side: adds masked inputs as they arrive, then reveals their sum.

    It never holds an unmasked individual input: it adds masked vectors (mod 2**64) and
    removes masks only from their sum.
    """

    def __init__(
        self,
        template: Mapping[str, np.ndarray],
        members: Sequence[Member],
        *,
        threshold: int,
        context: bytes,
        degree: int = 0,
    ) -> None:
        self.members = _ordered(members)
        self.threshold = threshold
        self.context = context
        self.degree = degree
        self._template = {n: template[n] for n in sorted(template)}
        self._sum = np.zeros(sum(int(a.size) for a in self._template.values()), np.int64)
        self.survivors: list[str] = []
        self._member_ids = frozenset(m.pid for m in self.members)
        self._added: set[str] = set()  # the survivors, as a set (O(1) per check)
        self.graph = graph_of(self.members, degree, context)
        self.share_threshold = share_threshold(len(self.members), degree, threshold)

    def check(self, pid: str, masked: Mapping[str, np.ndarray]) -> None:
        """Raise SecureAggregationError if :meth:`add` would refuse this input."""
        if pid not in self._member_ids or pid in self._added:
            raise SecureAggregationError(f"{pid}: not a member, or a second masked input")
        if set(masked) != set(self._template) or any(
            np.shape(masked[n]) != self._template[n].shape for n in self._template
        ):
            raise SecureAggregationError(f"{pid}: masked input of the wrong layout")

    def add(self, pid: str, masked: Mapping[str, np.ndarray]) -> None:
        """Add a member's masked input (mod 2**64); ``pid`` becomes a survivor. Raises as
        :meth:`check` does."""
        self.check(pid, masked)
        offset = 0
        with np.errstate(over="ignore"):
            for name in self._template:  # no concatenated copy: add slice by slice
                part = np.asarray(masked[name], np.int64).reshape(-1)
                self._sum[offset : offset + part.size] += part
                offset += part.size
        self.survivors.append(pid)
        self._added.add(pid)

    @property
    def dropped(self) -> list[str]:
        alive = set(self.survivors)
        return [m.pid for m in self.members if m.pid not in alive]

    def check_revealable(self) -> None:
        """Raise unless the survivors' sum can be revealed without exposing anyone: at
        least ``threshold`` survivors, none without a surviving neighbour and, in a
        sparse graph, each with ``share_threshold`` surviving neighbours (the holders of
        its self mask). Asked before anyone is asked to disclose, and again at reveal.

        Raises:
            SecureAggregationError: one of these does not hold.
        """
        if len(self.survivors) < self.threshold:
            raise SecureAggregationError(
                f"{len(self.survivors)} masked inputs, threshold {self.threshold}"
            )
        alone = isolated_survivors(self.members, self.survivors, self.degree, self.context)
        if alone:
            raise SecureAggregationError(
                f"{alone} have no surviving neighbour: revealing would expose their input"
            )
        groups = self.graph.groups(self.survivors)
        if groups > 1:
            raise SecureAggregationError(
                f"the survivors fall into {groups} unconnected groups: their sums could be "
                "revealed one by one, each of fewer members than the sum"
            )
        short = self.graph.short_of(self.survivors, self.share_threshold)
        if short:
            raise SecureAggregationError(
                f"{short} have fewer than {self.share_threshold} surviving neighbours: "
                "their self masks cannot be removed"
            )

    def reveal(self, disclosures: Mapping[str, Disclosure]) -> NamedArrays:
        """The sum of the survivors' values, from the survivors' disclosures.

        Raises:
            SecureAggregationError: what :meth:`check_revealable` refuses; fewer shares
                of a self mask than :attr:`share_threshold`; or a survivor that did not
                disclose its pairwise seed with a dropped neighbour.
        """
        self.check_revealable()
        self_mask: dict[str, dict[int, int]] = {}  # sender -> x -> y (one y per holder x)
        for answer in disclosures.values():
            for sender, (x, y) in answer.self_mask.items():
                self_mask.setdefault(sender, {})[x] = y
        total = self._sum.copy()
        streams = [
            (shamir.combine_points(self_mask.get(pid, {}), self.share_threshold), -1)
            for pid in self.survivors
        ]
        survivors = set(self.survivors)
        for pid in self.dropped:
            near = survivors.intersection(self.graph.near(pid))
            for survivor in sorted(near):
                answer = disclosures.get(survivor)
                if answer is None or pid not in answer.pair_seeds:
                    raise SecureAggregationError(
                        f"{survivor} did not disclose its pairwise seed with dropped {pid}: "
                        "its mask stays in the sum"
                    )
                # the survivor added +stream if it sorts before the dropped member
                streams.append((answer.pair_seeds[pid], -1 if survivor < pid else +1))
        prg.add_streams(streams, total)
        return _unflatten(total, self._template)
