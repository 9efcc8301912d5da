"""Round modes: a plaintext round and a masked round behind one interface.

A mode is chosen once per attempt (:func:`mode_for`) and answers every question on which
the two kinds of round differ, so that the coordinator's phase loop asks them without
knowing which kind it runs:

===============  ===========================  ========================================
question         plaintext                    masked (secure aggregation)
===============  ===========================  ========================================
``begin``        build the exact aggregator   nothing yet: members are not fixed
``settle``       nothing                      fix the members once all reachable are
                                              keyed (or at the open deadline, the keyed
                                              ones if they are K), build the aggregator
``ready``        invited and reachable        members that are reachable
                 (and bound, if required)
``eligible``     every invited participant    the members
``invitation``   once per participant         again to members, once they are fixed
``table``        :data:`.admission.PLAINTEXT_  the same, + attestations and unmask
                 ROUND`                       responses while AGGREGATING; an update
                                              announces its next mask key
``check``        nothing (None)               when somebody dropped, the survivor set
                                              to every survivor (to attest), and when
                                              all of them attested; None otherwise
``unmask``       nothing (None)               the unmask requests to every survivor
                                              (with the attestations addressed to it),
                                              and when all of them answered
``reveal``       the sum, self-checked        the same, from the disclosed shares
===============  ===========================  ========================================

``admission`` is each mode's table as the flat (state, kind) -> handler view. A masked
round needs its unmask exchange (and, when somebody dropped, the survivor check before
it) within the attempt: the mode only says what to send (``check``, ``unmask``); the
feeder that has a transport (the driver) sends it and admits the answers,
then the core reveals. :func:`require_exchange` is the one place the coordinator refuses a
feeder that cannot give it one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from lensemble_flwr.aggregation.fixed_point import AggregateSum, Aggregator
from lensemble_flwr.canonical import derive_seed
from lensemble_flwr.config import AggregationConfig, LensembleConfig
from lensemble_flwr.coordinator.admission import (
    ADMISSION,
    MASKED_ADMISSION,
    MASKED_ROUND,
    PLAINTEXT_ROUND,
    RoundTable,
    Table,
    install_aggregator,
    record_invitation,
)
from lensemble_flwr.coordinator.attempt import Attempt
from lensemble_flwr.coordinator.reach import ReachMemo
from lensemble_flwr.errors import ConfigError, NonDeterministicAggregation
from lensemble_flwr.identity.registry import ParticipantRegistry
from lensemble_flwr.protocol.messages import (
    ControlMessage,
    RoundOpen,
    SurvivorCheck,
    UnmaskRequest,
)
from lensemble_flwr.secagg import prg
from lensemble_flwr.secagg.aggregator import SecureAggregator, check_capacity
from lensemble_flwr.secagg.participant_role import encode_member, encode_named
from lensemble_flwr.secagg.protocol import Member, context_of
from lensemble_flwr.transports.base import COORDINATOR

log = logging.getLogger(__name__)

AggregatorFactory = Callable[[Mapping[str, np.ndarray], AggregationConfig, int], Aggregator]

Exchange = Callable[[Mapping[str, ControlMessage], Callable[[], bool]], None]
"""``exchange(requests, done)``: send each request (a SurvivorCheck or an UnmaskRequest)
to its recipient and admit what comes back until ``done()`` or the exchange's deadline.
Only a feeder that can wait for further exchanges within one attempt has one (the
blocking loop); the others pass None."""


@dataclass(frozen=True)
class UnmaskRound:
    """What one of a masked round's exchanges after the updates (the survivor check, the
    unmask) sends and when it is complete."""

    requests: Mapping[str, ControlMessage]
    """One request per survivor that holds shares, by recipient."""
    done: Callable[[], bool]
    """True once every request was answered (nothing more to wait for)."""


class RoundMode(Protocol):
    """What a kind of round decides; see the module's table."""

    name: str
    secure_sum: bool
    table: RoundTable  # state -> what it admits and how it is left
    admission: Table  # the same table as (state, kind) -> handler
    readiness: str  # what "ready" means, for messages

    def begin(self, attempt: Attempt) -> None:
        """Prepare a new attempt (its aggregator, where the mode can build it already)."""

    def settle(self, attempt: Attempt, reachable: set[str], *, final: bool) -> None:
        """Decide what waits on who is reachable; ``final`` at the open deadline."""

    def ready(self, attempt: Attempt, reachable: set[str]) -> set[str]:
        """The participants counted towards the quorum now."""

    def eligible(self, attempt: Attempt) -> set[str]:
        """The participants whose updates this attempt may sum."""

    def invitation(self, attempt: Attempt, peer: str) -> RoundOpen | None:
        """The RoundOpen to send ``peer`` now, or None when it needs none."""

    def check(self, attempt: Attempt) -> UnmaskRound | None:
        """The survivor check the attempt needs before its unmask exchange (None: none)."""

    def unmask(self, attempt: Attempt) -> UnmaskRound | None:
        """The unmask exchange the attempt needs before its sum is revealed (None: none)."""

    def reveal(self, attempt: Attempt) -> AggregateSum:
        """The attempt's sum, self-checked (:func:`revealed_and_checked`)."""


def revealed_and_checked(aggregator: Aggregator) -> AggregateSum:
    """Reveal the sum and self-check it; a mismatch is re-summed once (computed again
    from the admitted inputs, :meth:`~.Aggregator.resum`, not re-read), a second raises.

    Raises:
        NonDeterministicAggregation: the re-sum did not reproduce either.
    """
    result = aggregator.reveal()
    try:
        aggregator.verify(result)
    except NonDeterministicAggregation as exc:
        log.warning("self-check mismatch, re-summing once: %s", exc)
        result = aggregator.resum()
        aggregator.verify(result)
    return result


class PlaintextMode:
    """Each update is summed exactly as it arrives (the coordinator sees it)."""

    name = "plaintext"
    secure_sum = False
    table: RoundTable = PLAINTEXT_ROUND
    admission: Table = ADMISSION

    def __init__(
        self,
        config: LensembleConfig,
        registry: ParticipantRegistry,
        aggregator_factory: AggregatorFactory,
    ) -> None:
        self.config = config
        self.registry = registry
        self.aggregator_factory = aggregator_factory
        self.readiness = "invited and bound" if config.federation.require_binding else "invited"
        self._memo = ReachMemo()  # ready is asked after every message: O(1) if unchanged
        self._invitations: dict[tuple[int, int, bool], RoundOpen] = {}

    def begin(self, attempt: Attempt) -> None:
        """Build the attempt's exact aggregator (its self-check seed derives from the root
        seed, the round and the attempt)."""
        self._memo.forget()  # it names the previous attempt: let its sums go first
        self._invitations = {}  # and its RoundOpens (they hold the model they sent)
        seed = derive_seed(
            self.config.federation.root_seed, "self-check", attempt.round, attempt.number
        )
        install_aggregator(
            attempt, self.aggregator_factory(attempt.state.params, self.config.aggregation, seed)
        )

    def settle(self, attempt: Attempt, reachable: set[str], *, final: bool) -> None:
        """Nothing to settle: whoever is invited may contribute."""
        return None

    def ready(self, attempt: Attempt, reachable: set[str]) -> set[str]:
        """The invited participants that are reachable (and bound, when the federation
        requires binding)."""
        bound = self.registry.commitments if self.config.federation.require_binding else None
        return self._memo.ready(attempt, reachable, bound)  # remembered: do not modify

    def eligible(self, attempt: Attempt) -> set[str]:
        """Every invited participant."""
        return attempt.invited

    def invitation(self, attempt: Attempt, peer: str) -> RoundOpen | None:
        """The attempt's RoundOpen, once per participant (asking an unbound one for its
        dataset commitment); None once ``peer`` was invited."""
        if peer in attempt.invited:
            return None
        record_invitation(attempt, peer)
        needs = not self.registry.is_bound(peer)
        # every bound (every unbound) recipient gets the same frozen RoundOpen: a transport
        # encodes it once for all of them, as FedAvg's nodes share one instruction
        key = (attempt.round, attempt.number, needs)
        shared = self._invitations.get(key)
        if shared is None:  # (begin forgets the previous attempt's)
            shared = attempt.round_open.model_copy(update={"needs_commitment": needs})
            self._invitations[key] = shared
        return shared

    def check(self, attempt: Attempt) -> None:
        """A plaintext sum needs no survivor check."""
        return None

    def unmask(self, attempt: Attempt) -> None:
        """A plaintext sum needs no unmask exchange."""
        return None

    def reveal(self, attempt: Attempt) -> AggregateSum:
        """The exact sum, self-checked."""
        assert attempt.aggregator is not None  # built by begin
        return revealed_and_checked(attempt.aggregator)


def _member_ids(attempt: Attempt) -> frozenset[str]:
    """The attempt's member ids: its secure aggregator's set, built once when the members
    were fixed (the invitation asks for every reachable peer, each time it is called)."""
    if isinstance(attempt.aggregator, SecureAggregator):
        return attempt.aggregator.member_ids
    return frozenset(m.pid for m in attempt.members or [])


def admission_tables() -> dict[str, Table]:
    """The admission table of each round mode, by name (for the docs)."""
    return {PlaintextMode.name: PlaintextMode.admission, MaskedMode.name: MASKED_ADMISSION}


def masked_aggregation(config: LensembleConfig) -> AggregationConfig:
    """The bounds a masked sum is checked against: ``config``'s, except that under uniform
    weighting every weight is 1, so ``max-weight`` is 1 (at the default 2**16 the int64
    capacity would cap a masked round at 511 members)."""
    if config.largest_weight == config.aggregation.max_weight:
        return config.aggregation
    return config.aggregation.model_copy(update={"max_weight": config.largest_weight})


class MaskedMode:
    """Pairwise-masked updates; only their sum is ever revealed (secure aggregation)."""

    name = "masked"
    secure_sum = True
    table: RoundTable = MASKED_ROUND
    admission: Table = MASKED_ADMISSION
    readiness = "members: bound with an unspent mask key when the member set was fixed"

    def __init__(self, config: LensembleConfig, registry: ParticipantRegistry, run_id: str) -> None:
        self.config = config
        self.registry = registry
        self.run_id = run_id
        self._encoded: tuple[list[Member] | None, tuple[str, ...], tuple[str, ...]] = (
            None,
            (),
            (),
        )
        self._index: dict[str, int] = {}

    def _encoded_members(self, attempt: Attempt, peer: str) -> tuple[str, ...]:
        """The member list as ``peer``'s RoundOpen carries it, encoded once per member set:
        every member with its keys (full graph; every member's invitation carries all of
        it) or, in a sparse graph, ``peer`` and its neighbours with their keys and every
        other member by its id only (``pid::``): nobody else's keys are of use to it."""
        members, encoded, named = self._encoded
        if members is not attempt.members:
            encoded = tuple(encode_member(m) for m in attempt.members or [])
            named = tuple(encode_named(m) for m in attempt.members or [])
            self._encoded = (attempt.members, encoded, named)
            self._index = {m.pid: i for i, m in enumerate(attempt.members or [])}
        aggregator = attempt.aggregator
        if not isinstance(aggregator, SecureAggregator) or not aggregator.graph.sparse:
            return encoded
        listed = list(named)
        for pid in (peer, *aggregator.graph.near(peer)):
            listed[self._index[pid]] = encoded[self._index[pid]]
        return tuple(listed)

    def begin(self, attempt: Attempt) -> None:
        """Nothing yet: the aggregator needs the member set (:meth:`settle`)."""
        return None

    def settle(self, attempt: Attempt, reachable: set[str], *, final: bool) -> None:
        """Fix the members, once: when every reachable participant is keyed, or at the open
        deadline (``final``) the keyed ones, provided they reach the quorum. Spends their
        mask keys (persisting the registry) and builds the secure aggregator."""
        if attempt.members is not None:
            return
        answering = reachable - set(attempt.refused)  # a refusal (an error reply) is final
        keyed = sorted(p for p in answering if self.registry.keyed(p))
        if len(keyed) < self.config.federation.quorum:
            return
        if not final and set(keyed) != answering:
            return  # somebody is still committing its keys
        aggregation = masked_aggregation(self.config)
        check_capacity(len(keyed), aggregation)  # before any key is spent
        members = self.registry.members(keyed)  # spends their mask keys: durably, so
        self.registry.persist()  # that no restart lists a key a participant deleted
        fed = self.config.federation
        aggregator = SecureAggregator(
            attempt.state.params,
            aggregation,
            members=members,
            threshold=fed.secagg_threshold,
            context=context_of(self.run_id, attempt.round, attempt.number),
            degree=fed.secagg_neighbours,
        )
        install_aggregator(attempt, aggregator, members)

    def ready(self, attempt: Attempt, reachable: set[str]) -> set[str]:
        """The members that are invited and reachable (none before the members are fixed)."""
        return attempt.invited & reachable & _member_ids(attempt)

    def eligible(self, attempt: Attempt) -> set[str]:
        """The members."""
        return set(_member_ids(attempt))

    def invitation(self, attempt: Attempt, peer: str) -> RoundOpen | None:
        """The RoundOpen with the masking parameters: once per participant, and again to
        each member, with the member list, once the members are fixed. A keyed
        participant that is not a member gets none: with no member list and no
        commitment to ask for, it would ask nothing of it (over Flower its empty answer
        reads as a refusal of the attempt); it is invited with the members if it is one."""
        if peer in attempt.invited and (attempt.members is None or peer in attempt.members_sent):
            return None  # the common answer: asked for every reachable peer, many times
        members = _member_ids(attempt)
        if peer not in members and self.registry.keyed(peer):
            return None  # e.g. while a member whose key was spent commits a fresh one
        resend = peer in members and peer not in attempt.members_sent
        if peer in attempt.invited and not resend:
            return None
        record_invitation(attempt, peer, with_members=peer in members)
        fed = self.config.federation
        changes: dict[str, object] = {
            # a member masks with the key the members list; anyone else needs an unspent
            # key (and a binding) to be a member of a later attempt
            "needs_commitment": peer not in members and not self.registry.keyed(peer),
            "secagg_threshold": fed.secagg_threshold,
            "secagg_neighbours": fed.secagg_neighbours,
            "secagg_prg": prg.PRG_ID,
        }
        if peer in members:
            changes["secagg_members"] = self._encoded_members(attempt, peer)
        return attempt.round_open.model_copy(update=changes)

    def check(self, attempt: Attempt) -> UnmaskRound | None:
        """When somebody dropped, the survivor set to every survivor, to attest to the
        others before anyone discloses; complete once every survivor attested. None when
        nobody dropped (steady state: the round stays at two exchanges).

        Raises:
            SecureAggregationError: the sum cannot be revealed (nobody is asked).
        """
        aggregator = attempt.aggregator
        assert isinstance(aggregator, SecureAggregator)
        partition = aggregator.survivor_set()
        if partition is None:
            return None
        survivors, dropped = partition
        check = SurvivorCheck(
            run_id=self.run_id,
            round=attempt.round,
            attempt=attempt.number,
            sender=COORDINATOR,
            survivors=survivors,
            dropped=dropped,
        )  # one frozen message for every survivor: a transport encodes it once
        return UnmaskRound(dict.fromkeys(survivors, check), aggregator.all_attested)

    def unmask(self, attempt: Attempt) -> UnmaskRound:
        """The disclosure requests, one to every survivor that holds shares, each with the
        attestations addressed to it; the exchange is complete once every survivor
        disclosed.

        Raises:
            SecureAggregationError: the sum cannot be revealed, or a survivor would get
                too few attestations to disclose (nobody is asked).
        """
        aggregator = attempt.aggregator
        assert isinstance(aggregator, SecureAggregator)
        aggregator.check_attested()
        requests = aggregator.disclosure_requests()
        messages = {
            holder: UnmaskRequest(
                run_id=self.run_id,
                round=attempt.round,
                attempt=attempt.number,
                sender=COORDINATOR,
                survivors=request.survivors,
                dropped=request.dropped,
                sealed=request.sealed_hex,
                attestations=request.attestations,
            )
            for holder, request in requests.items()
        }
        return UnmaskRound(messages, aggregator.all_disclosed)

    def reveal(self, attempt: Attempt) -> AggregateSum:
        """The checked sum, from what the unmask exchange disclosed."""
        aggregator = attempt.aggregator
        assert isinstance(aggregator, SecureAggregator)
        return revealed_and_checked(aggregator)


def require_exchange(mode: RoundMode, exchange: Exchange | None) -> None:
    """Refuse a masked round (it needs its unmask exchange within the attempt) to a
    feeder that has no ``exchange`` to give it (a batch of collected messages).

    Raises:
        ConfigError: ``mode`` is masked and ``exchange`` is None.
    """
    if mode.secure_sum and exchange is None:
        raise ConfigError(
            "secagg-threshold",
            "a masked round needs an unmask exchange within the attempt, which a batch "
            "of collected messages does not carry; run it with Coordinator.run",
        )


def mode_for(
    config: LensembleConfig,
    registry: ParticipantRegistry,
    *,
    run_id: str,
    aggregator_factory: AggregatorFactory,
) -> RoundMode:
    """The mode the config asks for: masked when ``secagg-threshold`` > 0."""
    if config.federation.masked:
        return MaskedMode(config, registry, run_id)
    return PlaintextMode(config, registry, aggregator_factory)
