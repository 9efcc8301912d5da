"""The coordinator's record of who takes part, and the ingress checks that rest on it.

A participant is *bound* by its Commitment: a dataset root and an example count, and
optionally an identity key (to sign with) and X25519 keys (for masked rounds). A binding
outlives rounds and coordinator restarts: the registry is durable in the run's store
(:mod:`.durable`), written whenever it changed and before anything that depends on it can
reach the ledger. The checks here are the ones that ask "is this message really from a
participant, bound as it says": signatures, dataset roots, example counts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import (
    CommitmentMismatch,
    ConfigError,
    ForgedMessage,
    RoundError,
    UnboundContribution,
)
from lensemble_flwr.identity.registry_store import load_registry, save_registry
from lensemble_flwr.identity.signing import parse_public_key, verify_signature
from lensemble_flwr.protocol.messages import Commitment, ParticipantMessage, Update
from lensemble_flwr.secagg.membership import Membership
from lensemble_flwr.secagg.protocol import Member

log = logging.getLogger(__name__)


class ParticipantRegistry:
    """Bindings, identity keys and masked-round membership of a run's participants.

    Args:
        config: the federation's config (``require-binding``, ``require-signatures``).
        store: the run's store, where the registry is kept.
        identities: an allow-list of participant id → OpenSSH public identity key; None
            lets a participant register its key with its first Commitment.

    Raises:
        ConfigError: an allow-listed key is not an OpenSSH NIST P-256/P-384 key.
    """

    def __init__(
        self,
        config: LensembleConfig,
        store: Store,
        identities: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.identities = dict(identities) if identities is not None else None
        for pid, key in (self.identities or {}).items():
            try:
                parse_public_key(key)
            except ForgedMessage as exc:
                raise ConfigError(f"identities[{pid}]", str(exc)) from None
        self.commitments: dict[str, Commitment] = {}
        self.membership = Membership()  # masked rounds: the unspent mask keys
        self._dirty = False
        self._warned_unbound: set[str] = set()

    def restore(self) -> None:
        """Replace the in-memory registry with the stored one (after a restart)."""
        self.commitments, self.membership = load_registry(self.store)
        self._dirty = False

    # -- who is bound -------------------------------------------------------------------
    def is_bound(self, pid: str) -> bool:
        """Whether ``pid`` has committed to its dataset (the registry holds its binding)."""
        return pid in self.commitments

    def keyed(self, pid: str) -> bool:
        """Bound with a sealing key and an unspent mask key: may be a masked-round member."""
        return self.membership.keyed(self.commitments.get(pid))

    def members(self, pids: Iterable[str]) -> list[Member]:
        """The members ``pids`` with their keys; listing them spends their mask keys."""
        members = self.membership.members(pids, self.commitments)
        self._dirty = True
        return members

    def bind(self, commitment: Commitment) -> None:
        """Bind a participant to its dataset root; the binding outlives the round.

        Raises:
            CommitmentMismatch: the participant is bound to another dataset root.
        """
        pid = commitment.participant_id
        prior = self.commitments.get(pid)
        if prior is not None and prior.dataset_root != commitment.dataset_root:
            raise CommitmentMismatch(
                f"{pid} is bound to {prior.dataset_root[:12]}… and committed "
                f"{commitment.dataset_root[:12]}…"
            )
        if prior is None:
            log.info("%s bound to dataset root %s…", pid, commitment.dataset_root[:12])
        # the identity key is fixed at the first commitment (check_signature refuses any
        # other): a later commitment that omits it keeps it, and it is stored normalized
        key = prior.identity_key if prior is not None else commitment.identity_key
        commitment = commitment.model_copy(
            update={"identity_key": None if key is None else key.strip()}
        )
        if commitment != prior:
            self.membership.rebound(prior, commitment)
            self.commitments[pid] = commitment
            self._dirty = True

    # -- masked rounds ------------------------------------------------------------------
    def announce(self, pid: str, mask_key: str) -> None:
        """``pid`` announced its next round's mask key (kept with the next persist)."""
        self.membership.announce(pid, mask_key)
        self._dirty = True

    def persist(self) -> None:
        """Store the registry if it changed since it was last stored."""
        if self._dirty:
            save_registry(self.store, self.commitments, self.membership)
            self._dirty = False

    # -- ingress checks -----------------------------------------------------------------
    def check_signature(
        self,
        msg: ParticipantMessage,
        round_seed: int,
        fields: Mapping[str, Any] | None = None,
    ) -> None:
        """A participant with a registered identity key must sign with it; a Commitment
        may register a key (unless the allow-list fixes it) but never change it.
        ``fields``: the message's canonical fields, when already computed.

        Raises:
            ForgedMessage: not on the allow-list, unsigned where a signature is required,
                claims another key than the registered one, or a bad signature.
        """
        pid = msg.participant_id
        bound = self.commitments.get(pid)
        if self.identities is not None:
            if pid not in self.identities:
                raise ForgedMessage(f"{pid}: not on the coordinator's identity allow-list")
            key: str | None = self.identities[pid]
        else:
            key = bound.identity_key if bound is not None else None
        if isinstance(msg, Commitment) and msg.identity_key is not None:
            if key is not None and msg.identity_key.strip() != key.strip():
                raise ForgedMessage(f"{pid}: commitment claims another identity key")
            if key is None and bound is not None:
                # bound without a key: the key is fixed at the first commitment, as the
                # ledger's registries record it (verify refuses a key appearing later)
                raise ForgedMessage(f"{pid}: bound without an identity key; cannot add one")
            key = msg.identity_key
        if key is None:
            if self.config.federation.require_signatures:
                raise ForgedMessage(f"{pid}: no registered identity key; signatures required")
            return
        verify_signature(msg, key, round_seed, fields)

    def key_of(self, pid: str) -> str | None:
        """``pid``'s identity key: the allow-list's, or the one bound with its commitment
        (None: it has none)."""
        if self.identities is not None:
            return self.identities.get(pid)
        bound = self.commitments.get(pid)
        return bound.identity_key if bound is not None else None

    def has_key(self, pid: str) -> bool:
        """Whether ``pid`` has an identity key its messages can be checked against: named
        in the allow-list, or bound with its commitment."""
        if self.identities is not None:
            return pid in self.identities
        bound = self.commitments.get(pid)
        return bound is not None and bound.identity_key is not None

    def signs(self, pid: str) -> bool:
        """Whether ``pid``'s messages must carry its signature: an allow-list, a key
        bound with its commitment, or ``require-signatures``."""
        if self.identities is not None or self.config.federation.require_signatures:
            return True
        bound = self.commitments.get(pid)
        return bound is not None and bound.identity_key is not None

    def registered(self, pid: str) -> bool:
        """Bound by a Commitment, or named in the identity allow-list."""
        return pid in self.commitments or (self.identities is not None and pid in self.identities)

    def check_binding(self, update: Update) -> None:
        """An update is bound to its sender's committed root and example count (or, where
        the config allows it, openly unbound). A participant that committed is bound for
        good: an unbound update from it is a CommitmentMismatch, whatever the config.

        Raises:
            CommitmentMismatch: a registered sender's update is unbound after it committed,
                is bound to a root it never committed, or to another root than the
                committed one (its response stops the federation: INV-COMMIT-BINDING).
            UnboundContribution: an unregistered sender's update is unbound while
                ``require-binding`` is set, or bound to a root it never committed (a
                rejected message: only a registered participant can stop the federation).
            RoundError: another example count than the committed one.
        """
        pid = update.participant_id
        commitment = self.commitments.get(pid)
        if update.dataset_root is None:
            if commitment is not None:
                raise CommitmentMismatch(
                    f"{pid} committed to {commitment.dataset_root[:12]}… and sent an "
                    "unbound update: a participant that committed stays bound"
                )
            if self.config.federation.require_binding:
                raise UnboundContribution(
                    f"{pid}: update without a dataset commitment (a stock ClientApp?) "
                    "refused because require-binding is set"
                )
            if pid not in self._warned_unbound:
                self._warned_unbound.add(pid)
                log.warning(
                    "%s contributes UNBOUND updates: no dataset commitment, no participant-side "
                    "alignment or privacy; they are recorded as unbound in the ledger",
                    pid,
                )
            return
        if commitment is None:
            error = CommitmentMismatch if self.registered(pid) else UnboundContribution
            raise error(f"{pid}: update bound to {update.dataset_root[:12]}…, never committed")
        if update.dataset_root != commitment.dataset_root:
            raise CommitmentMismatch(
                f"{pid}: update bound to {update.dataset_root[:12]}…, committed "
                f"{commitment.dataset_root[:12]}…"
            )
        if update.num_examples != commitment.num_examples:
            raise RoundError(f"{pid}: update and commitment disagree on num_examples")
