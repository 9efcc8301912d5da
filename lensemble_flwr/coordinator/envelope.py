"""The envelope step: what every message must be before any round table looks at it.

:func:`check_envelope` checks, in order: the round still listens, the message is one a
participant may send, it names this run, its sender is invited or registered, its
signature (a late message is authenticated too, with its own round's seed) — or, for a
refusal the coordinator's own transport filed, that the transport may file it — and
whether it is this attempt's, another attempt's (late; an exact copy of an update that
attempt admitted is a replay) or one with nothing to record. It writes nothing: it
returns where the message goes (:class:`Route`), and the caller hands it to a handler.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable, Mapping
from typing import Any

from lensemble_flwr.canonical import derive_seed
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.attempt import Attempt
from lensemble_flwr.errors import (
    ForgedMessage,
    IllegalMessage,
    LensembleError,
    ReplayedMessage,
    RoundError,
)
from lensemble_flwr.identity.registry import ParticipantRegistry
from lensemble_flwr.protocol.messages import (
    Commitment,
    ControlMessage,
    ParticipantMessage,
    Refusal,
    SurvivorAttestation,
    UnmaskResponse,
    Update,
    WirePayload,
    canonical_fields,
    from_wire,
    message_digest,
)
from lensemble_flwr.transports.base import TRANSPORT_ERRORS

log = logging.getLogger(__name__)

PARTICIPANT_MESSAGES: tuple[type[ParticipantMessage], ...] = (
    Commitment,
    Update,
    Refusal,
    UnmaskResponse,
    SurvivorAttestation,
)
"""The message types a participant may send at all."""


def no_figures(participant_id: str) -> float | None:
    """No ledger figure for anyone: what an :class:`Ingress` built without one checks
    updates against (nothing recorded yet)."""
    return None


@dataclasses.dataclass(frozen=True)
class Ingress:
    """What admission checks a message against, besides the attempt itself.

    Attributes:
        config: the federation's config.
        run_id: the run every message must name.
        registry: bindings and identity keys.
        admitted_digests: ``(round, attempt)`` → the update digests the manifest records
            as admitted in that attempt (None for an attempt it does not hold): how a
            late exact copy of an admitted update is recognised as a replay.
        spent_before: participant → the largest cumulative epsilon seen from it in
            the run's ledger records and in the updates its attempts admitted, aborted
            ones included (None: none), which its next update must exceed
            (:mod:`.spent`).
    """

    config: LensembleConfig
    run_id: str
    registry: ParticipantRegistry
    admitted_digests: Callable[[int, int], Mapping[str, str] | None]
    spent_before: Callable[[str], float | None] = dataclasses.field(default=no_figures)


class Route(str, enum.Enum):
    """Where a message that passed its envelope goes."""

    CURRENT = "current"  # this attempt's: to the round table's handler
    LATE = "late"  # another attempt's, authenticated: filed as late
    DROPPED = "dropped"  # nothing to record or wait for: dropped unfiled


def check_envelope(
    attempt: Attempt,
    msg: ControlMessage,
    ingress: Ingress,
    listening: bool,
    fields: Mapping[str, Any] | None = None,
    *,
    filed_by_transport: bool = False,
    vouched: bool = False,
) -> tuple[Route, Mapping[str, Any]]:
    """Check ``msg``'s envelope against ``attempt`` (see the module); change nothing.

    ``listening``: whether the attempt's phase admits any message. ``fields``: the
    message's :func:`canonical_fields`, if already computed. ``filed_by_transport`` and
    ``vouched``: as :func:`~.admission.admit` takes them.

    Returns:
        The route, and the message's canonical fields (computed here if not given).

    Raises:
        IllegalMessage: the round no longer listens, or a kind no participant may send.
        RoundError: another run's message, a sender neither invited nor registered or a
            bad signature (ForgedMessage), a replay (ReplayedMessage).
    """
    if not listening:
        raise IllegalMessage(f"the round is {attempt.phase.value}: it admits no message")
    if not isinstance(msg, PARTICIPANT_MESSAGES):
        raise IllegalMessage(f"a participant may not send {msg.kind} (from {msg.sender})")
    if msg.run_id != ingress.run_id:
        raise RoundError(f"{msg.sender}: message of run {msg.run_id!r}")
    pid = msg.participant_id
    current = (msg.round, msg.attempt) == (attempt.round, attempt.number)
    if pid not in attempt.invited and not ingress.registry.is_bound(pid):
        if not current:  # e.g. a stock client that was offline this attempt: dropped,
            log.info("round %d: late %s from unknown %s dropped", attempt.round, msg.kind, pid)
            return Route.DROPPED, fields or {}  # and not filed: nobody unknown files
        raise ForgedMessage(f"{pid}: neither invited to this round nor a registered participant")
    if fields is None:
        fields = canonical_fields(msg)  # hashes an update's arrays: once, here
    if filed_by_transport:
        if not _transport_may_file(attempt, msg, ingress, vouched, current):
            return Route.DROPPED, fields
    else:  # late ones too: nothing unsigned
        ingress.registry.check_signature(msg, signing_seed(attempt, ingress, msg.round), fields)
    if not current:
        _check_replay(msg, ingress, fields)
        return Route.LATE, fields
    return Route.CURRENT, fields


def signing_seed(attempt: Attempt, ingress: Ingress, round: int) -> int:
    """The round seed a participant's message of ``round`` is signed under: the current
    attempt's, or (another round's message) the one derived for that round."""
    if round == attempt.round:
        return attempt.state.sketch_seed
    return derive_seed(ingress.config.federation.root_seed, "round", round)


def signed_for_its_name(attempt: Attempt, payload: WirePayload, ingress: Ingress) -> bool:
    """Whether ``payload`` is a participant's message of this run that its sender's name
    accepts as that participant's own: signed by the key registered for the name (in
    the allow-list, or bound with a commitment), or by the key a first commitment
    registers; unsigned only where the name has no key and no signature is required.

    This is the check a transport that learns names from its peers' messages (Flower's)
    asks before it binds a name to the node a message came from: a node that cannot
    sign for a name does not get it. Nothing is changed; a malformed payload is not
    accepted."""
    try:
        msg = from_wire(payload)
        if not isinstance(msg, PARTICIPANT_MESSAGES) or msg.run_id != ingress.run_id:
            return False
        ingress.registry.check_signature(msg, signing_seed(attempt, ingress, msg.round))
    except _UNPROVEN:
        return False
    return True


_UNPROVEN = (LensembleError, ValueError, TypeError, LookupError, AttributeError, ArithmeticError)
"""What checking a payload that is not well formed may raise: it proves nothing."""


def _transport_may_file(
    attempt: Attempt, msg: ParticipantMessage, ingress: Ingress, vouched: bool, current: bool
) -> bool:
    """Whether a refusal the coordinator's transport filed for a node is to be handled
    (False: dropped, there is nothing to stop waiting for).

    Raises:
        IllegalMessage: it is not a refusal of the transport's own.
        ForgedMessage: the participant signs, and no signed message of that node was
            admitted yet (a node squatting an absent participant's name files nothing).
    """
    pid = msg.participant_id
    if not isinstance(msg, Refusal) or msg.error not in TRANSPORT_ERRORS:
        raise IllegalMessage(
            f"a transport files only refusals of its own ({sorted(TRANSPORT_ERRORS)}), "
            f"not this {msg.kind}"
        )
    if ingress.registry.signs(pid) and not vouched:
        raise ForgedMessage(
            f"{pid}: a refusal the transport filed for a node that has not signed as {pid} yet"
        )
    if not current or pid in attempt.admitted:
        log.debug("round %d: %s's %s dropped", attempt.round, pid, msg.error)
        return False
    return True


def _check_replay(msg: ParticipantMessage, ingress: Ingress, fields: Mapping[str, Any]) -> None:
    """A message of another attempt is late, never admitted; if it is an exact copy of an
    update the manifest records as admitted in its attempt, it is a replay.

    Raises:
        ReplayedMessage: the copy of an admitted update.
    """
    if not isinstance(msg, Update):
        return
    digests = ingress.admitted_digests(msg.round, msg.attempt)
    if digests is not None and digests.get(msg.participant_id) == message_digest(msg, fields):
        raise ReplayedMessage(
            f"{msg.participant_id}: update of round {msg.round} attempt {msg.attempt} "
            "was admitted then; the copy is refused"
        )
