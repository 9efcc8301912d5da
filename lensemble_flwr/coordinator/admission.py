"""Message admission as data: one round table per mode, and the attempt's only writers.

Every message a participant sends reaches the round through :func:`admit`, whoever
collected it (the blocking loop over a transport, Flower's stock ``aggregate_train``, the
shared-folder decider). :func:`admit` first runs the one envelope step
(:func:`~.envelope.check_envelope`: a round that still listens, a kind a participant may
send, this run, an invited or registered sender, its signature, late or replay), then
looks the pair (``attempt.phase``, ``type(message)``) up in the mode's round table. A
pair without an entry raises :class:`~lensemble_flwr.errors.IllegalMessage`. A handler
checks everything before it changes anything, so the typed error it raises leaves the
attempt as it was — with one deliberate exception: a Refusal is recorded before the
error it reports is raised (it is the participant's word, not a fault of the message).

A round table (:data:`PLAINTEXT_ROUND`, :data:`MASKED_ROUND`) maps
each state to its :class:`Phase`: the handler of each message kind it admits, and the
exit rule (:mod:`.exits`) by which ``advance`` leaves it. The flat views
(:data:`ADMISSION`, :data:`MASKED_ADMISSION`: (state, kind) → handler) are derived from
them. Both tables and all their handlers live here, so that admitting a message enters
this module once and never comes back to it from a mode.

The handlers, and the named writers below them for what is not a message (an
invitation, the attempt's sample, a rename, a rejected message, the aggregator and the
member set), are the only code that writes an :class:`~.attempt.Attempt`.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from lensemble_flwr.aggregation.fixed_point import Aggregator
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.attempt import Attempt
from lensemble_flwr.coordinator.endorsements import take_endorsement
from lensemble_flwr.coordinator.envelope import (
    PARTICIPANT_MESSAGES,
    Ingress,
    Route,
    check_envelope,
)
from lensemble_flwr.coordinator.exits import LEAVE_COLLECTING, LEAVE_OPEN, ExitRule
from lensemble_flwr.coordinator.spent import check_spent
from lensemble_flwr.errors import (
    DuplicateMessage,
    ForgedMessage,
    IllegalMessage,
    PrivacyBudgetExceeded,
    PrivacyBudgetUnreadable,
    Response,
    RoundError,
    SecureAggregationError,
    UnalignableUpdate,
    UnprivatizedContribution,
    reported,
    response_to,
)
from lensemble_flwr.gauge.runtime import check_sketch
from lensemble_flwr.privacy.budget import SENSITIVITY_FACTORS, noise_stage_name
from lensemble_flwr.privacy.distributed import DISTRIBUTED_NOISE
from lensemble_flwr.protocol.messages import (
    Commitment,
    ControlMessage,
    MessageKind,
    ParticipantMessage,
    Refusal,
    SurvivorAttestation,
    UnmaskResponse,
    Update,
    WirePayload,
    kind_of,
    message_digest,
)
from lensemble_flwr.protocol.round import TRANSITIONS, RoundState
from lensemble_flwr.release.binding import bind
from lensemble_flwr.release.differencing import difference
from lensemble_flwr.secagg.aggregator import SecureAggregator
from lensemble_flwr.secagg.keys import check_public_key
from lensemble_flwr.secagg.protocol import Disclosure, Member
from lensemble_flwr.transports.base import CLIENT_APP_ERROR, STOCK_CLIENTAPP, DeliveredFrom

log = logging.getLogger(__name__)

class Verdict(str, enum.Enum):
    """What admitting one message did."""

    BOUND = "bound"  # a Commitment bound (or re-confirmed) its sender
    ADMITTED = "admitted"  # an Update entered the round's sum
    REFUSED = "refused"  # the sender releases nothing this attempt
    DISCLOSED = "disclosed"  # a masked round's unmask response was recorded
    ATTESTED = "attested"  # a masked round's survivor attestation was recorded
    LATE = "late"  # of another attempt, or an update after collection closed: filed


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
    asked more often than that is expected to refuse the rest, and the others go on. A
    budget that cannot be read or was rolled back is not expected, and stops it."""
    pid = msg.participant_id
    attempt.refused[pid] = f"{msg.error}: {msg.reason}"
    # an error reply: the transport that filed it logged it, with the node and its text
    level = logging.DEBUG if msg.error == CLIENT_APP_ERROR else logging.WARNING
    log.log(level, "round %d: %s releases nothing: %s", attempt.round, pid, attempt.refused[pid])
    error = reported(msg.error, f"{pid}: {msg.reason}")
    spent = isinstance(error, PrivacyBudgetExceeded) and not isinstance(
        error, PrivacyBudgetUnreadable
    )  # spent, not unreadable or rolled back
    if spent and ingress.config.federation.sampled:
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
    base = DISTRIBUTED_NOISE if privacy.distributed else "gaussian_noise"
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


RAW_PLAINTEXT_STAGES = frozenset({difference().name, bind().name, STOCK_CLIENTAPP})
"""The release stages an update may declare and still be a raw plaintext delta: it was
differenced (and bound to its data), or it is a stock ClientApp's reply. Anything else it
names (clip, noise, int8 quantization, alignment, a stage of a custom chain) transformed
what it releases."""


def check_raw_plaintext(update: Update, field: str) -> None:
    """Refuse, by its metadata, an update that is not a raw plaintext delta: what a
    coordinator-side transform of individual updates (the alignment harness, a research
    ``update_transform``) may be given. Aligning int8 codes, or a clipped or noised delta,
    as if they were raw deltas would sum something else than what was released
    (INV-ALIGN-BEFORE-RELEASE).

    Raises:
        UnalignableUpdate: it declares a stage outside :data:`RAW_PLAINTEXT_STAGES`, or it
            is quantized (``scales``), masked or carries a privacy cost (``epsilon``).
    """
    declared = [
        what
        for what, on in (
            ("int8 scales", update.scales is not None),
            ("a mask", update.masked),
            (f"epsilon {update.epsilon}", update.epsilon is not None),
        )
        if on
    ]
    declared += [f"stage {t!r}" for t in update.transforms if t not in RAW_PLAINTEXT_STAGES]
    if declared:
        raise UnalignableUpdate(
            f"{update.participant_id}: update released with {', '.join(declared)}; the "
            "coordinator transforms only raw plaintext deltas (a participant configured "
            "otherwise than the federation); refused",
            field,
        )


def check_update(attempt: Attempt, msg: Update, ingress: Ingress) -> Update:
    """Everything an update must be before it may be summed; returns what is summed (the
    update itself, or the research harness's transform of it).

    Raises:
        DuplicateMessage, UnboundContribution, CommitmentMismatch, RoundError (also: the
        sender was not invited to the attempt), UnprivatizedContribution,
        PrivacyBudgetRolledBack, SketchMismatch, UnalignableUpdate (a coordinator-side
        transform is on): see the checks.
    """
    pid = msg.participant_id
    if pid in attempt.admitted:
        raise DuplicateMessage(f"{pid}: a second update in round {msg.round}; refused")
    if pid not in attempt.invited:  # e.g. a registered participant left out of the sample
        raise RoundError(f"{pid}: not invited to round {msg.round} attempt {msg.attempt}")
    ingress.registry.check_binding(msg)
    check_privacy(ingress.config, msg)
    check_spent(ingress.spent_before(pid), msg)  # a budget that lost what it spent
    if attempt.sketch_fingerprint is not None:
        check_sketch(msg, attempt.sketch_fingerprint)
    if attempt.aggregator is None:
        raise RoundError(f"{pid}: update before the masked round's members were fixed")
    if attempt.transform is None:
        return msg
    harness = ingress.config.gauge.coordinator_harness
    check_raw_plaintext(msg, "gauge-coordinator-harness" if harness else "update_transform")
    return attempt.transform(msg)


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




# -- the attempt's other writers: what is not a message ---------------------------------
def record_invitation(attempt: Attempt, peer: str, *, with_members: bool = False) -> None:
    """``peer`` is sent the attempt's RoundOpen (``with_members``: the one that lists a
    masked round's fixed members)."""
    attempt.invited.add(peer)
    if with_members:
        attempt.members_sent.add(peer)


def record_sample(attempt: Attempt, sample: frozenset[str]) -> None:
    """The attempt's sample is drawn (once: :mod:`.sampling`)."""
    assert attempt.sample is None, "an attempt draws its sample once"
    attempt.sample = sample


def install_aggregator(
    attempt: Attempt, aggregator: Aggregator, members: list[Member] | None = None
) -> None:
    """The attempt's aggregator is built (a masked round's, with its fixed ``members``)."""
    attempt.aggregator = aggregator
    if members is not None:
        attempt.members = members


def rename_invitee(attempt: Attempt, address: str, participant: str) -> None:
    """The peer invited (or sampled) as ``address`` is ``participant``: its invitation
    and its place in the sample follow the participant's own name. Both sets are
    replaced, not changed: what was derived from the old ones is stale."""
    if address in attempt.invited:
        attempt.invited = (attempt.invited - {address}) | {participant}
    if attempt.sample is not None and address in attempt.sample:
        attempt.sample = (attempt.sample - {address}) | {participant}


def record_rejection(
    attempt: Attempt, payload: WirePayload, error: Exception, *, keyless: bool = False
) -> None:
    """A message was rejected: counted. A rejected update that the transport took from
    the invited node's own reply to this attempt
    (:class:`~lensemble_flwr.transports.base.DeliveredFrom`) is that node's answer all
    the same: it will not send another, so the round stops waiting for it, and the
    attempt records why it contributed nothing. Nothing else is changed (a rejection of
    anything else, or of a message whose sender no transport vouches for, still waits:
    in process anyone may write any sender into a payload).

    A signature failure answers for nobody (another node may have taken the name), with
    two exceptions: an update the transport made of a stock ClientApp's reply, from a
    participant with no key (``keyless``): nothing such a node sends can ever be signed,
    so waiting for it (under ``require-signatures``) could only wait out the deadline;
    and an update the transport delivered from a peer under another name than the
    peer's own (a node that claimed a name it could not sign for: its answer is its
    own, under the name it has, never the claimed one's)."""
    attempt.rejected += 1
    if not isinstance(payload, DeliveredFrom) or kind_of(payload) is not MessageKind.UPDATE:
        return
    stock = tuple(payload.get("transforms") or ()) == (STOCK_CLIENTAPP,)
    claimed = payload.get("participant_id") != payload.peer
    if isinstance(error, ForgedMessage) and not (stock and keyless) and not claimed:
        return
    if (payload.round, payload.attempt) != (attempt.round, attempt.number):
        return
    if attempt.phase not in (RoundState.OPEN, RoundState.COLLECTING):
        return
    peer = payload.peer
    if peer not in attempt.invited or peer in attempt.admitted or peer in attempt.refused:
        return
    attempt.refused[peer] = f"RejectedUpdate: {type(error).__name__}: {str(error)[:500]}"


def file_late_message(
    attempt: Attempt, msg: ParticipantMessage, ingress: Ingress, fields: Mapping[str, Any]
) -> Verdict:
    """A message of another attempt, authenticated by the envelope step: filed as late."""
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


# -- the round table ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Phase:
    """One state's row of a round table: what it admits, and how it is left."""

    admits: Mapping[type[ParticipantMessage], Handler]
    exit: ExitRule | None = None  # None: ``advance`` does not leave it


RoundTable = Mapping[RoundState, Phase]
"""A mode's round table: state -> :class:`Phase`. A state it does not list admits
nothing and is not left by ``advance``."""


def flat(table: RoundTable) -> Table:
    """The (state, message kind) -> handler view of a round table.

    Raises:
        AssertionError: an exit rule fires an event the transition table has no entry
            for from its state (a table that contradicts the round's state machine).
    """
    for state, phase in table.items():
        if phase.exit is not None:
            assert (state, phase.exit.event) in TRANSITIONS, (state, phase.exit.event)
    return MappingProxyType(
        {(state, kind): handler for state, p in table.items() for kind, handler in p.admits.items()}
    )


_S = RoundState
PLAINTEXT_ROUND: RoundTable = MappingProxyType(
    {
        _S.OPEN: Phase(
            {Commitment: bind_commitment, Update: admit_update, Refusal: record_refusal},
            LEAVE_OPEN,
        ),
        _S.COLLECTING: Phase(
            {Commitment: bind_commitment, Update: admit_update, Refusal: record_refusal},
            LEAVE_COLLECTING,
        ),
        _S.AGGREGATING: Phase(
            {Commitment: bind_commitment, Update: file_late_update, Refusal: record_refusal}
        ),
    }
)
"""The plaintext round's table. ALIGNING, COMMITTING and the terminal states admit
nothing: the round no longer listens."""

ADMISSION: Table = flat(PLAINTEXT_ROUND)
"""The plaintext round's admission, as (state, message kind) -> handler."""


# -- the masked round: member updates announce a key; AGGREGATING takes disclosures --
def admit_member_update(
    attempt: Attempt, msg: Update, ingress: Ingress, fields: Mapping[str, Any]
) -> Verdict:
    """Admit a member's update. Once it passed every check, the mask key it announces
    for its next round becomes its unspent key (kept with the registry, which is stored
    before the sum is revealed), then the update is folded."""
    summed = check_update(attempt, msg, ingress)
    aggregator = attempt.aggregator
    assert isinstance(aggregator, SecureAggregator)  # check_update: members are fixed
    aggregator.check(summed, weight=ingress.config.federation.weight_of(msg.num_examples))
    check_usable_key(msg.participant_id, "next_mask_key", msg.next_mask_key)
    if msg.next_mask_key is not None:
        ingress.registry.announce(msg.participant_id, msg.next_mask_key)
    return fold_update(attempt, msg, summed, ingress, fields)


def take_disclosure(
    attempt: Attempt, msg: UnmaskResponse, ingress: Ingress, fields: Mapping[str, Any]
) -> Verdict:
    """Admit a survivor's unmask response: hand its disclosed shares and seeds to the
    secure aggregator."""
    assert isinstance(attempt.aggregator, SecureAggregator)  # fixed before COLLECTING
    attempt.aggregator.disclose(msg.participant_id, _parse_shares(msg))
    return Verdict.DISCLOSED


def take_attestation(
    attempt: Attempt, msg: SurvivorAttestation, ingress: Ingress, fields: Mapping[str, Any]
) -> Verdict:
    """Admit a survivor's attestations of the survivor set, to be relayed with the unmask
    requests (the coordinator checks who they are from and to, not the tags: it cannot)."""
    assert isinstance(attempt.aggregator, SecureAggregator)  # fixed before COLLECTING
    attempt.aggregator.attest(msg.participant_id, msg.tags)
    return Verdict.ATTESTED


def _with(phase: Phase, **admits: Any) -> Phase:
    """``phase`` with the handlers of the message kinds named (by class name) replaced."""
    kinds = {kind.__name__: kind for kind in (Update, UnmaskResponse, SurvivorAttestation)}
    return Phase({**phase.admits, **{kinds[k]: h for k, h in admits.items()}}, phase.exit)


MASKED_ROUND: RoundTable = MappingProxyType(
    {
        RoundState.OPEN: _with(PLAINTEXT_ROUND[RoundState.OPEN], Update=admit_member_update),
        RoundState.COLLECTING: _with(
            PLAINTEXT_ROUND[RoundState.COLLECTING], Update=admit_member_update
        ),
        RoundState.AGGREGATING: _with(
            PLAINTEXT_ROUND[RoundState.AGGREGATING],
            UnmaskResponse=take_disclosure,
            SurvivorAttestation=take_attestation,
        ),
    }
)
"""A masked round's table: the plaintext one, with member updates that announce their
next mask key, and the survivor attestations and unmask responses of AGGREGATING."""

MASKED_ADMISSION: Table = flat(MASKED_ROUND)
"""The masked round's admission, as (state, message kind) -> handler."""


def _parse_shares(response: UnmaskResponse) -> Disclosure:
    """An UnmaskResponse as a Disclosure ('x:y_hex' shares as (x, y); seeds as bytes)."""
    self_mask = {}
    try:
        for s, v in response.b_shares.items():
            parts = v.split(":")  # once (fields after the second are ignored, as always)
            self_mask[s] = (int(parts[0]), int(parts[1], 16))
    except (ValueError, IndexError):
        raise RoundError(f"{response.participant_id}: malformed shares") from None
    pair_seeds = {d: bytes.fromhex(h) for d, h in response.pair_seeds.items()}  # hex: checked
    return Disclosure(self_mask=self_mask, pair_seeds=pair_seeds)


# -- the step -----------------------------------------------------------------------------
def admit(
    attempt: Attempt,
    msg: ControlMessage,
    ingress: Ingress,
    table: Table,
    fields: Mapping[str, Any] | None = None,
    *,
    filed_by_transport: bool = False,
    vouched: bool = False,
) -> Verdict:
    """Admit one validated message into ``attempt``, or raise and change nothing.

    The envelope step (:func:`~.envelope.check_envelope`) first, then ``table``'s handler
    for (``attempt.phase``, the message's kind). ``fields``: the message's
    :func:`canonical_fields`, if already computed (a batch hashed on threads,
    :mod:`.batch`). ``filed_by_transport``: a Refusal the coordinator's own transport
    filed for the node (:class:`~lensemble_flwr.transports.base.FiledByTransport`): no
    signature of the node is asked for, and it stops nothing, whatever error it names;
    for a participant that signs, only when ``vouched`` (a signed message from the same
    node was admitted before). One of another attempt, or for a participant already
    admitted, is dropped.

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
    listening = any(state is attempt.phase for state, _ in table)
    route, fields = check_envelope(
        attempt, msg, ingress, listening, fields,
        filed_by_transport=filed_by_transport, vouched=vouched,
    )  # fmt: skip
    if route is Route.DROPPED:
        return Verdict.LATE
    assert isinstance(msg, PARTICIPANT_MESSAGES)  # check_envelope
    if route is Route.LATE:
        return file_late_message(attempt, msg, ingress, fields)
    handler = table.get((attempt.phase, type(msg)))
    if handler is None:
        raise IllegalMessage(
            f"{msg.participant_id}: a {msg.kind} is not admitted while the round is "
            f"{attempt.phase.value}"
        )
    verdict = handler(attempt, msg, ingress, fields)
    if verdict in (Verdict.BOUND, Verdict.ADMITTED):  # the message is in: so is what it endorses
        take_endorsement(attempt, msg, ingress.registry)
    return verdict

def admission_table(tables: Mapping[str, Table]) -> str:
    """A markdown table of which state admits which message type, and with what handler,
    for each named table (rendered into docs/runtime.md); states that admit nothing in
    any table are left out."""
    kinds = [Commitment, Update, Refusal, SurvivorAttestation, UnmaskResponse]
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
