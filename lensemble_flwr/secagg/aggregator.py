"""The coordinator's aggregator for a masked round: it adds masked inputs and reveals
only their sum, after one disclosure exchange with the surviving members.

The revealed sum is the int64 fixed-point sum the plaintext aggregator would have
computed from the same releases, bit for bit; it is the only input of the outer step.
The self-check reveals the sum a second time from the recorded transcript (the running
masked sum and the disclosed shares) and compares: never by asking for individual inputs.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from lensemble_flwr.aggregation.fixed_point import AggregateSum
from lensemble_flwr.config import AggregationConfig
from lensemble_flwr.errors import (
    ConfigError,
    NonDeterministicAggregation,
    RoundError,
    SecureAggregationError,
)
from lensemble_flwr.protocol.messages import Update
from lensemble_flwr.secagg import shamir
from lensemble_flwr.secagg.consistency import attestations_needed
from lensemble_flwr.secagg.protocol import Disclosure, MaskedSum, Member, NeighbourGraph


@dataclasses.dataclass(frozen=True)
class DisclosureRequest:
    """What one surviving member is asked: its share of each survivor's self mask
    (sealed for it by that survivor) and its pairwise seed with each dropped neighbour.
    The shares stay in the hex they arrived in (checked then): the request carries them
    so, with no second conversion of C x C shares."""

    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    sealed_hex: dict[str, str]  # survivor -> its share sealed for this holder, as it came
    attestations: dict[str, str] = dataclasses.field(default_factory=dict)  # attester -> tag

    @property
    def self_mask_shares(self) -> dict[str, bytes]:
        """The sealed shares as bytes (``sealed_hex`` decoded)."""
        return {s: bytes.fromhex(c) for s, c in self.sealed_hex.items()}


def check_capacity(members: int, config: AggregationConfig) -> None:
    """Refuse a masked sum of ``members`` inputs that could overflow int64: each is at
    most ``max-weight`` x ``max-abs-update`` x 2**``fraction-bits`` in absolute value.

    Raises:
        ConfigError: it could.
    """
    bound = members * config.max_weight * config.guarded_bound() * 2.0**config.fraction_bits
    if bound >= 2.0**63:
        raise ConfigError(
            "secagg-threshold",
            f"{members} members x max-weight {config.max_weight} x max-abs-update "
            f"{config.guarded_bound():g} x 2**fraction-bits {config.fraction_bits} could "
            "overflow the int64 sum: lower max-weight (uniform weighting needs 1) or "
            "fraction-bits, or sample fewer members",
        )


class SecureAggregator:
    """Aggregator (see ``lensemble_flwr.aggregation.fixed_point.Aggregator``) over masked updates.

    Args:
        template: names and shapes of the global params.
        config: the aggregation config (fixed-point grid and bounds).
        members: the round's members and their public keys.
        threshold: the round's threshold t: fewest survivors of a revealed sum, and (full
            graph) shares needed to recover a mask secret; in a sparse graph a survivor's
            self mask needs ``protocol.share_threshold`` of its neighbours' shares.
        context: the round attempt's context (``protocol.context_of``).
        degree: the neighbour graph (0: every member masks with every other).
    """

    def __init__(
        self,
        template: Mapping[str, np.ndarray],
        config: AggregationConfig,
        *,
        members: Sequence[Member],
        threshold: int,
        context: bytes,
        degree: int = 0,
    ) -> None:
        check_capacity(len(members), config)
        self._config = config
        self._sum = MaskedSum(
            template, members, threshold=threshold, context=context, degree=degree
        )
        self._member_ids = frozenset(m.pid for m in members)
        self._graph = self._sum.graph
        self._holder_x = {pid: i + 1 for i, pid in enumerate(sorted(self._member_ids))}
        self._x_of: dict[str, dict[str, int]] = {}  # sparse: sender -> holder -> its x
        self._self_shares: dict[str, Mapping[str, str]] = {}  # sender -> its sealed (hex)
        self._weights: dict[str, int] = {}
        self._disclosures: dict[str, Disclosure] = {}
        self._attestations: dict[str, dict[str, str]] = {}  # attester -> recipient -> tag
        self._revealed: AggregateSum | None = None
        self._parsed: tuple[Update, dict[str, bytes], Mapping[str, str]] | None = None

    def admit(self, update: Update, *, weight: int) -> None:
        """Fold a member's masked update into the sum, or raise and change nothing."""
        self.check(update, weight=weight)
        pid = update.participant_id
        self._sum.add(pid, update.delta)  # checks again: cheap, and add stands alone
        assert self._parsed is not None and self._parsed[0] is update  # check just read it
        self._self_shares[pid] = self._parsed[2]
        self._weights[pid] = weight

    def check(self, update: Update, *, weight: int) -> dict[str, bytes]:
        """Everything :meth:`admit` checks, without admitting; returns the sealed
        self-mask shares.

        Raises:
            RoundError: not a masked update of a member that may still contribute.
        """
        pid = update.participant_id
        if not update.masked or update.sealed_shares is None:
            raise RoundError(f"{pid}: a masked round admits masked updates only")
        if pid not in self._member_ids:
            raise RoundError(f"{pid}: not a member of this masked round")
        if pid in self._weights or self._revealed is not None:
            raise RoundError(f"{pid}: already contributed, or the round is revealed")
        if not 1 <= weight <= self._config.max_weight:
            raise RoundError(f"{pid}: weight {weight} outside [1, {self._config.max_weight}]")
        shares = self._shares_of(update)
        self._sum.check(pid, update.delta)
        return shares

    def _shares_of(self, update: Update) -> dict[str, bytes]:
        """The update's sealed shares as bytes, one to every member; read once per update
        (messages are immutable: the coordinator's check and admit share the reading)."""
        if self._parsed is not None and self._parsed[0] is update:
            return dict(self._parsed[1])
        pid, sealed = update.participant_id, update.sealed_shares or {}
        try:
            shares = {h: bytes.fromhex(c) for h, c in sealed.items()}
        except ValueError:
            raise RoundError(f"{pid}: sealed shares are not hex") from None
        if self._graph.sparse:
            if shares.keys() != self._graph.near(pid):
                raise RoundError(f"{pid}: self-mask shares must go to its neighbours, and only")
        elif shares.keys() != self._member_ids:
            raise RoundError(f"{pid}: self-mask shares must go to every member")
        canonical = all(
            len(c) == 2 * len(b) and c == c.lower()
            for c, b in zip(sealed.values(), shares.values(), strict=True)
        )  # as bytes.hex() writes them (else forwarded re-encoded, as they always were)
        self._parsed = (
            update,
            shares,
            sealed if canonical else {h: b.hex() for h, b in shares.items()},
        )
        return dict(shares)

    def survivor_set(self) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
        """The partition the survivors are asked to attest once the contributing set is
        frozen, as (survivors, dropped); None when nobody dropped (a member that sees no
        drop discloses no pairwise seed, and needs no attestation).

        Raises:
            SecureAggregationError: the sum cannot be revealed, so nobody is asked
                anything (:meth:`~.protocol.MaskedSum.check_revealable`).
        """
        if not self._sum.dropped:
            return None
        self._sum.check_revealable()
        return tuple(sorted(self._sum.survivors)), tuple(self._sum.dropped)

    def attest(self, attester: str, tags: Mapping[str, str]) -> None:
        """Record a survivor's attestations of the survivor set, to be relayed; or raise
        and record nothing. The coordinator cannot check a tag (it does not hold the
        key): it checks who sends them to whom.

        Raises:
            RoundError: nobody dropped (nothing to attest), the attester is not a
                survivor or attested already, or a tag is addressed to anyone but its
                surviving neighbours (every other survivor with the full graph).
        """
        if not self._sum.dropped:
            raise RoundError(f"{attester}: nobody dropped: there is no survivor set to attest")
        if attester not in self._weights:
            raise RoundError(f"{attester}: only survivors attest the survivor set")
        if attester in self._attestations:
            raise RoundError(f"{attester}: attested the survivor set already")
        strangers = set(tags) - (set(self._weights) & self._graph.near(attester))
        if strangers:
            raise RoundError(
                f"{attester}: attestations addressed to {sorted(strangers)[:3]}, who are not "
                "its surviving neighbours"
            )
        self._attestations[attester] = dict(tags)

    def all_attested(self) -> bool:
        """Whether every survivor's attestations arrived."""
        return len(self._attestations) == len(self._weights)

    def _attestations_for(self, holder: str) -> dict[str, str]:
        return {a: tags[holder] for a, tags in self._attestations.items() if holder in tags}

    def check_attested(self) -> None:
        """Refuse (before anyone is asked to disclose) when somebody dropped and a
        survivor would get fewer attestations than it needs to disclose (it would
        refuse, and the sum could not be revealed).

        Raises:
            SecureAggregationError: some survivor would.
        """
        if not self._sum.dropped:
            return
        survivors = sorted(self._sum.survivors)
        need = attestations_needed(
            len(self._member_ids), self._graph.degree, self._sum.threshold,
            sparse=self._graph.sparse,
        )  # fmt: skip
        counts = collections.Counter(r for tags in self._attestations.values() for r in tags)
        short = [s for s in survivors if counts[s] < need]
        if short:
            raise SecureAggregationError(
                f"{short[:3]} would get fewer than {need} attestations of the survivor set "
                "(survivors that did not attest count as not answering)"
            )

    def disclosure_requests(self) -> dict[str, DisclosureRequest]:
        """What to ask each survivor once the contributing set is frozen: in a sparse
        graph, only the shares its surviving neighbours dealt it.

        Each request carries the attestations of the survivor set addressed to its
        holder (:meth:`attest`; none when nobody dropped).

        Raises:
            SecureAggregationError: (sparse graph) the sum cannot be revealed, so nobody
                is asked anything (:meth:`~.protocol.MaskedSum.check_revealable`).
        """
        survivors = tuple(sorted(self._sum.survivors))
        dropped = tuple(self._sum.dropped)
        if self._graph.sparse:
            self._sum.check_revealable()
            alive = set(survivors)
            return {
                holder: DisclosureRequest(
                    survivors=survivors,
                    dropped=dropped,
                    sealed_hex={
                        s: self._self_shares[s][holder]
                        for s in sorted(alive.intersection(self._graph.near(holder)))
                    },
                    attestations=self._attestations_for(holder),
                )
                for holder in survivors
            }
        columns = [(s, self._self_shares[s]) for s in survivors]
        return {
            holder: DisclosureRequest(
                survivors=survivors,
                dropped=dropped,
                sealed_hex={s: sealed[holder] for s, sealed in columns},
                attestations=self._attestations_for(holder),
            )
            for holder in survivors
        }

    def disclose(self, holder: str, disclosure: Disclosure) -> None:
        """Record one survivor's disclosure, or raise and record nothing.

        Raises:
            RoundError: the holder is not a survivor, it names a self mask of anyone but
                a survivor or a pairwise seed with anyone but a dropped member (which
                covers disclosing both of one sender), or a seed is not 32 bytes.
        """
        if holder not in self._weights:
            raise RoundError(f"{holder}: only survivors disclose")
        survivors, dropped = set(self._weights), set(self._sum.dropped)
        if not set(disclosure.self_mask) <= survivors:
            raise RoundError(f"{holder}: disclosed the self mask of a member that dropped")
        if self._graph.sparse and not set(disclosure.self_mask) <= self._graph.near(holder):
            raise RoundError(f"{holder}: disclosed a share of a member it is no neighbour of")
        if not set(disclosure.pair_seeds) <= dropped:
            raise RoundError(f"{holder}: disclosed a pairwise seed with a survivor")
        if any(len(seed) != 32 for seed in disclosure.pair_seeds.values()):
            raise RoundError(f"{holder}: a pairwise seed is not 32 bytes")
        position = self._holder_x[holder]  # shares were dealt to the members in id order
        for sender, (x, y) in disclosure.self_mask.items():
            if self._graph.sparse:  # ... or to the sender's neighbours, in id order
                position = self._position(sender, holder)
            if x != position or not 0 <= y < shamir.PRIME:
                raise RoundError(
                    f"{holder}: its share of {sender}'s self mask is not the one dealt to it "
                    f"(x = {x}, its own is {position})"
                )
        self._disclosures[holder] = disclosure

    def _position(self, sender: str, holder: str) -> int:
        """The point x of ``sender``'s share dealt to ``holder`` (sparse graph)."""
        found = self._x_of.get(sender)
        if found is None:
            found = {h: i + 1 for i, h in enumerate(self._graph.holders(sender))}
            self._x_of[sender] = found
        return found[holder]

    @property
    def graph(self) -> NeighbourGraph:
        """The round attempt's neighbour graph."""
        return self._graph

    @property
    def member_ids(self) -> frozenset[str]:
        """The round's member ids (built once: asked for every message of the round)."""
        return self._member_ids

    @property
    def dropped(self) -> list[str]:
        return self._sum.dropped

    @property
    def disclosed(self) -> list[str]:
        """The survivors whose disclosures arrived."""
        return list(self._disclosures)

    def all_disclosed(self) -> bool:
        """Whether every survivor's disclosure arrived (only survivors disclose, and once
        each: a count, asked after every message of the exchange)."""
        return len(self._disclosures) == len(self._weights)

    def reveal(self) -> AggregateSum:
        """Unmask the survivors' sum from the disclosures recorded so far, as read-only
        arrays (raises as :meth:`lensemble_flwr.secagg.protocol.MaskedSum.reveal` does)."""
        sums = self._sum.reveal(self._disclosures)
        for array in sums.values():
            array.setflags(write=False)
        self._revealed = AggregateSum(
            sums=sums,
            total_weight=sum(self._weights.values()),
            contributors=tuple(sorted(self._weights)),
            fraction_bits=self._config.fraction_bits,
            checksum=0,
        )
        return self._revealed

    def resum(self) -> AggregateSum:
        """The sum unmasked again from the recorded transcript (each :meth:`reveal`
        computes it afresh), for a second check when the first failed."""
        return self.reveal()

    def verify(self, result: AggregateSum) -> None:
        """Reveal again from the recorded transcript and compare, bit for bit."""
        try:
            again = self._sum.reveal(self._disclosures)
        except SecureAggregationError as exc:
            raise NonDeterministicAggregation(f"the transcript no longer reveals: {exc}") from None
        same = set(again) == set(result.sums) and all(
            np.array_equal(again[n], result.sums[n]) for n in again
        )
        if not same or result.contributors != tuple(sorted(self._weights)):
            raise NonDeterministicAggregation("the revealed sum does not reproduce")
