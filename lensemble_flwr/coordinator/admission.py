"""Message admission as data: one table from (round state, message type) to a handler.

Every message a participant sends reaches the round through :func:`admit`, whoever
collected it (the blocking loop over a transport, Flower's stock ``aggregate_train``, the
shared-folder decider). :func:`admit` checks the envelope first — a round that still
listens, a kind a participant may send, this run, this round attempt (an older attempt's
message is filed as late, or refused as a replay), a valid signature — and then looks the
pair (``attempt.phase``, ``type(message)``) up in the table. A pair without an entry
raises :class:`~lensemble_flwr.errors.IllegalMessage`. A handler checks everything before
it changes anything, so the typed error it raises leaves the attempt as it was — with one
deliberate exception: a Refusal is recorded before the error it reports is raised (it is
the participant's word, not a fault of the message).

The base table (:data:`ADMISSION`) is the plaintext round's; a round mode adds or replaces
entries (a masked round admits unmask responses while AGGREGATING, and keeps the next
mask key each member announces with its update).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from lensemble_flwr.canonical import derive_seed
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.attempt import Attempt
from lensemble_flwr.errors import (
    DuplicateMessage,
    ForgedMessage,
    IllegalMessage,
    PrivacyBudgetExceeded,
    ReplayedMessage,
    Response,
    RoundError,
    SecureAggregationError,
    UnprivatizedContribution,
    reported,
    response_to,
)
from lensemble_flwr.gauge.runtime import check_sketch
from lensemble_flwr.identity.registry import ParticipantRegistry
from lensemble_flwr.privacy.budget import SENSITIVITY_FACTORS, noise_stage_name
from lensemble_flwr.privacy.distributed import DISTRIBUTED_NOISE
from lensemble_flwr.protocol.messages import (
    Commitment,
    ControlMessage,
    ParticipantMessage,
    Refusal,
    UnmaskResponse,
    Update,
    canonical_fields,
    message_digest,
)
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.secagg.keys import check_public_key
from lensemble_flwr.transports.base import CLIENT_APP_ERROR, TRANSPORT_ERRORS

log = logging.getLogger(__name__)

PARTICIPANT_MESSAGES: tuple[type[ParticipantMessage], ...] = (
    Commitment,
    Update,
    Refusal,
    UnmaskResponse,
)
"""The message types a participant may send at all."""


class Verdict(str, enum.Enum):
    """What admitting one message did."""

    BOUND = "bound"  # a Commitment bound (or re-confirmed) its sender
    ADMITTED = "admitted"  # an Update entered the round's sum
    REFUSED = "refused"  # the sender releases nothing this attempt
    DISCLOSED = "disclosed"  # a masked round's unmask response was recorded
    LATE = "late"  # of another attempt, or an update after collection closed: filed


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
    """

    config: LensembleConfig
    run_id: str
    registry: ParticipantRegistry
    admitted_digests: Callable[[int, int], Mapping[str, str] | None]


Handler = Callable[[Attempt, Any, Ingress, Mapping[str, Any]], Verdict]
"""``(attempt, message, ingress, canonical fields) -> verdict``; raises, having changed
nothing, to refuse the message."""

Table = Mapping[tuple[RoundState, type[ParticipantMessage]], Handler]


# -- handlers ---------------------------------------------------------------------------
def bind_commitment(
    attempt: Attempt, msg: Commitment, ingress: Ingress, fields: Mapping[str, Any]
) -> Verdict:
    """Bind the sender to its dataset root (CommitmentMismatch if bound to another).

    Raises:
        RoundError: a masking key is not a usable X25519 public key (it would make every
            member's exchange with it fail): the message is rejected, nothing is bound.
    """
    for name in ("mask_key", "enc_key"):
        check_usable_key(msg.participant_id, name, getattr(msg, name))
    ingress.registry.bind(msg)
    return Verdict.BOUND


def check_usable_key(pid: str, name: str, key_hex: str | None) -> None:
    """Refuse a masking key that no X25519 exchange can use (a low-order point).

    Raises:
        RoundError: it is not one.
    """
    if key_hex is None:
        return
    try:
        check_public_key(bytes.fromhex(key_hex))
    except SecureAggregationError as exc:
        raise RoundError(f"{pid}: {name}: {exc}") from None


def record_refusal(
    attempt: Attempt, msg: Refusal, ingress: Ingress, fields: Mapping[str, Any]
) -> Verdict:
    """The sender releases nothing this attempt. An error whose response is to stop the
    federation (a spent privacy budget, a residency violation) stops it: raised after it
    is recorded, since it is the participant's word, not a fault of the message.

    Under sampling a spent budget stops nothing: the noise was planned for the releases
    a participant is *likely* asked for (``privacy.calibration.releases_of``), so one
    asked more often than that is expected to refuse the rest, and the others go on."""
    pid = msg.participant_id
    attempt.refused[pid] = f"{msg.error}: {msg.reason}"
    # an error reply: the transport that filed it logged it, with the node and its text
    level = logging.DEBUG if msg.error == CLIENT_APP_ERROR else logging.WARNING
    log.log(level, "round %d: %s releases nothing: %s", attempt.round, pid, attempt.refused[pid])
    error = reported(msg.error, f"{pid}: {msg.reason}")
    if isinstance(error, PrivacyBudgetExceeded) and ingress.config.federation.sampled:
        log.warning(
            "round %d: %s has spent its privacy budget: it is sampled past the planned "
            "releases (dp-overrun) and refuses from now on; the federation goes on",
            attempt.round,
            pid,
        )
        return Verdict.REFUSED
    if error is not None and response_to(error) is Response.STOP_FEDERATION:
        if not ingress.registry.is_bound(pid):
            # only a registered participant may stop the federation
            log.warning("round %d: %s is not registered: stops nothing", attempt.round, pid)
            return Verdict.REFUSED
        raise error
    return Verdict.REFUSED


def check_privacy(config: LensembleConfig, update: Update) -> None:
    """Refuse an update that did not go through the release stages the config requires
    (a stock ClientApp, or a participant configured without them). This checks what the
    participant declares; that the declaration is honest is its signature's job.

    Raises:
        UnprivatizedContribution: a required stage is missing.
    """
    privacy = config.privacy
    base = DISTRIBUTED_NOISE if privacy.dp_mode == "distributed" else "gaussian_noise"
    noise = noise_stage_name(base, privacy.dp_adjacency)
    needed = [
        stage for stage, on in (("clip", privacy.clip_norm > 0), (noise, privacy.noised)) if on
    ]
    missing = [stage for stage in needed if stage not in update.transforms]
    others = {noise_stage_name(base, a) for a in SENSITIVITY_FACTORS} - {noise}
    other = [t for t in update.transforms if t in others]
    if privacy.noised and other:
        raise UnprivatizedContribution(
            f"{update.participant_id}: update noised as {other[0]!r}, accounted under "
            f"another adjacency than the federation's dp-adjacency "
            f"{privacy.dp_adjacency!r} (stage {noise!r}); refused"
        )
    if missing:
        raise UnprivatizedContribution(
            f"{update.participant_id}: update released without {missing}, which the "
            "configuration requires; refused"
        )


def check_update(attempt: Attempt, msg: Update, ingress: Ingress) -> Update:
    """Everything an update must be before it may be summed; returns what is summed (the
    update itself, or the research harness's transform of it).

    Raises:
        DuplicateMessage, UnboundContribution, CommitmentMismatch, RoundError (also: the
        sender was not invited to the attempt), UnprivatizedContribution, SketchMismatch:
        see the checks.
    """
    pid = msg.participant_id
    if pid in attempt.admitted:
        raise DuplicateMessage(f"{pid}: a second update in round {msg.round}; refused")
    if pid not in attempt.invited:  # e.g. a registered participant left out of the sample
        raise RoundError(f"{pid}: not invited to round {msg.round} attempt {msg.attempt}")
    ingress.registry.check_binding(msg)
    check_privacy(ingress.config, msg)
    if attempt.sketch_fingerprint is not None:
        check_sketch(msg, attempt.sketch_fingerprint)
    if attempt.aggregator is None:
        raise RoundError(f"{pid}: update before the masked round's members were fixed")
    return attempt.transform(msg) if attempt.transform is not None else msg


def fold_update(
    attempt: Attempt, msg: Update, summed: Update, ingress: Ingress, fields: Mapping[str, Any]
) -> Verdict:
    """Fold a checked update into the round's sum and file it as admitted (the aggregator
    validates before it folds: it raises having changed nothing)."""
    assert attempt.aggregator is not None  # check_update
    pid = msg.participant_id
    attempt.aggregator.admit(summed, weight=ingress.config.federation.weight_of(msg.num_examples))
    attempt.admitted.add(pid)
    attempt.roots[pid] = msg.dataset_root
    attempt.epsilon[pid] = msg.epsilon
    attempt.update_digests[pid] = message_digest(msg, fields)  # as received
    return Verdict.ADMITTED


def admit_update(
    attempt: Attempt, msg: Update, ingress: Ingress, fields: Mapping[str, Any]
) -> Verdict:
    """Fold one plaintext update into the round's sum: once per participant, bound as
    committed, released through the required stages, aligned with the round's sketch."""
    if msg.masked:  # its values would bypass max-abs-update, and it is no sum's share here
        raise RoundError(f"{msg.participant_id}: a plaintext round admits no masked update")
    return fold_update(attempt, msg, check_update(attempt, msg, ingress), ingress, fields)


def file_late_update(
    attempt: Attempt, msg: Update, ingress: Ingress, fields: Mapping[str, Any]
) -> Verdict:
    """An update after the contributing set froze: filed as late, never admitted."""
    attempt.late.add(msg.participant_id)
    log.info(
        "round %d: update from %s after collection closed, dropped",
        attempt.round,
        msg.participant_id,
    )
    return Verdict.LATE


_S = RoundState
ADMISSION: Table = MappingProxyType(
    {
        (_S.OPEN, Commitment): bind_commitment,
        (_S.OPEN, Update): admit_update,
        (_S.OPEN, Refusal): record_refusal,
        (_S.COLLECTING, Commitment): bind_commitment,
        (_S.COLLECTING, Update): admit_update,
        (_S.COLLECTING, Refusal): record_refusal,
        (_S.AGGREGATING, Commitment): bind_commitment,
        (_S.AGGREGATING, Update): file_late_update,
        (_S.AGGREGATING, Refusal): record_refusal,
    }
)
"""The plaintext round's admission table. ALIGNING, COMMITTING and the terminal states
admit nothing: the round no longer listens."""


# -- the step ---------------------------------------------------------------------------
def admit(
    attempt: Attempt,
    msg: ControlMessage,
    ingress: Ingress,
    table: Table,
    fields: dict[str, Any] | None = None,
    *,
    filed_by_transport: bool = False,
    vouched: bool = False,
) -> Verdict:
    """Admit one validated message into ``attempt``, or raise and change nothing.
    ``fields``: the message's :func:`canonical_fields`, if already computed (a batch
    hashed on threads, :mod:`.batch`). ``filed_by_transport``: a Refusal the
    coordinator's own transport filed for the node
    (:class:`~lensemble_flwr.transports.base.FiledByTransport`): no signature of the
    node is asked for, and it stops nothing, whatever error it names; for a participant
    that signs, only when ``vouched`` (a signed message from the same node was admitted
    before). One of another attempt, or for a participant already admitted, is dropped.

    Raises:
        IllegalMessage: the round admits nothing in its state, a kind no participant may
            send, or one the round does not admit in its current state.
        RoundError: another run's message, a sender neither invited nor registered or a
            bad signature (ForgedMessage; a late message is authenticated too, with its own
            round's seed), a replay (ReplayedMessage), a duplicate, or whatever the
            handler refuses.
        LensembleError: an error whose response is not to reject the message (e.g. a
            CommitmentMismatch, or a Refusal that stops the federation).
    """
    if not any(state is attempt.phase for state, _ in table):
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
            return Verdict.LATE  # and not filed: nobody unknown writes to the manifest
        raise ForgedMessage(f"{pid}: neither invited to this round nor a registered participant")
    if fields is None:
        fields = canonical_fields(msg)  # hashes an update's arrays: once, here
    seed = (
        attempt.state.sketch_seed
        if msg.round == attempt.round
        else derive_seed(ingress.config.federation.root_seed, "round", msg.round)
    )
    if filed_by_transport:
        if not isinstance(msg, Refusal) or msg.error not in TRANSPORT_ERRORS:
            raise IllegalMessage(
                f"a transport files only refusals of its own ({sorted(TRANSPORT_ERRORS)}), "
                f"not this {msg.kind}"
            )
        if ingress.registry.signs(pid) and not vouched:
            # the name is the node's own, unsigned claim until a signed message from that
            # node was admitted: a node squatting an absent participant's name files nothing
            raise ForgedMessage(
                f"{pid}: a refusal the transport filed for a node that has not signed as {pid} yet"
            )
        if not current or pid in attempt.admitted:  # nothing to stop waiting for: dropped
            log.debug("round %d: %s's %s dropped", attempt.round, pid, msg.error)
            return Verdict.LATE
    else:
        ingress.registry.check_signature(msg, seed, fields)  # late ones too: nothing unsigned
    if not current:
        _check_replay(msg, ingress, fields)
        attempt.late.add(msg.sender)
        log.info(
            "round %d: late %s from %s (round %d attempt %d) dropped",
            attempt.round,
            msg.kind,
            msg.sender,
            msg.round,
            msg.attempt,
        )
        return Verdict.LATE
    handler = table.get((attempt.phase, type(msg)))
    if handler is None:
        raise IllegalMessage(
            f"{msg.participant_id}: a {msg.kind} is not admitted while the round is "
            f"{attempt.phase.value}"
        )
    return handler(attempt, msg, ingress, fields)


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


def admission_table(tables: Mapping[str, Table]) -> str:
    """A markdown table of which state admits which message type, and with what handler,
    for each named table (rendered into docs/runtime.md); states that admit nothing in
    any table are left out."""
    kinds = [Commitment, Update, Refusal, UnmaskResponse]
    states = [s for s in RoundState if any(state is s for t in tables.values() for state, _ in t)]
    rows = ["| round | state | " + " | ".join(k.__name__ for k in kinds) + " |"]
    rows.append("| --- | --- | " + " | ".join("---" for _ in kinds) + " |")
    for name, table in tables.items():
        for state in states:
            cells = []
            for kind in kinds:
                handler = table.get((state, kind))
                cells.append(f"`{handler.__name__.lstrip('_')}`" if handler else "refused")
            rows.append(f"| {name} | {state.name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
