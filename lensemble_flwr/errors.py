"""The typed error taxonomy and the response each error gets.

Every error the runtime raises derives from :class:`LensembleError`. What the
coordinator does about an error is not decided by ``if`` chains at the raise
site: it looks the error up in :data:`RESPONSES`, one table, through
:func:`response_to`. Subclasses inherit the response of their nearest listed
ancestor, so a new, more specific error cannot silently fall through.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType


class Response(str, enum.Enum):
    """What the runtime does when an error is raised."""

    REJECT_MESSAGE = "reject-message"
    """Drop the offending message, log it, and leave the round where it was."""

    RETRY_ROUND = "retry-round"
    """Abort the round (global state unchanged) and retry the same round index."""

    STOP_FEDERATION = "stop-federation"
    """Abort the round fail-closed and stop the federation; no retry."""

    REFUSE_RELEASE = "refuse-release"
    """Participant side: release nothing for this round (the coordinator sees a dropout)."""


class LensembleError(Exception):
    """Base class of every error lensemble-flwr raises on purpose."""


class RoundError(LensembleError):
    """A message or event that the current round cannot accept (malformed, wrong round,
    illegal transition)."""


class IllegalTransition(RoundError):
    """An event that the round state machine has no transition for."""


class IllegalMessage(RoundError):
    """A message whose kind the round does not admit in its current state (or that no
    participant may send at all)."""


class UnboundContribution(RoundError):
    """An update of a sender that never committed, where that is not allowed: unbound
    while the configuration requires binding, or bound to a root it never committed."""


class UnprivatizedContribution(RoundError):
    """An update that lacks the clipping or noise the configuration requires."""


class ParameterMismatch(RoundError):
    """Named arrays that do not fit a model or a template (unknown, missing or mis-shaped)."""


class InconsistentSizes(RoundError):
    """Shared-folder records of one round disagree about example counts: some state their
    size and some do not, or a stated size is not the size in the record's update."""


class ForgedMessage(RoundError):
    """A participant message that is unsigned where a signature is required, or not
    signed by the identity key its sender registered (for this round and attempt)."""


class ReplayedMessage(RoundError):
    """An update that was already admitted once, delivered again (a replay)."""


class DuplicateMessage(RoundError):
    """A second update from the same participant in one round attempt."""


class FaultToleranceExceeded(LensembleError):
    """Fewer than K participants present at the quorum check or during collection."""


class RoundIncomplete(FaultToleranceExceeded):
    """A shared-folder round whose deadline passed before every expected participant's
    record arrived; the error names the missing participants."""

    def __init__(self, message: str, *, missing: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.missing = missing


class ClaimantDied(FaultToleranceExceeded):
    """A shared-folder round (or run start) whose claimant never published: it died
    holding the claim, and a claim is never taken over; the error names the claimant."""

    def __init__(self, message: str, *, claimant: str = "") -> None:
        super().__init__(message)
        self.claimant = claimant


class SecureAggregationError(LensembleError):
    """Too few participants remain to unmask the secure sum."""


class NonDeterministicAggregation(LensembleError):
    """The aggregate did not reproduce under the self-check."""


class PrivacyBudgetExceeded(LensembleError):
    """A release would exceed a participant's (epsilon, delta) budget."""


class PrivacyBudgetUnreadable(PrivacyBudgetExceeded):
    """A participant's budget file cannot be read (corrupt, or not a budget): what was
    spent is unknown, so nothing is released until the file is restored."""


class PrivacyBudgetRolledBack(PrivacyBudgetUnreadable):
    """A participant's budget holds less than it is known to have spent: its file was
    deleted, replaced or rolled back since (seen by the participant, against the charge it
    last recorded, or by the coordinator, against the cumulative epsilon the participant
    last released into the run). Nothing more is released against it."""


class DPBoundViolation(LensembleError):
    """An update about to be noised is larger than the clip norm (INV-DP-BOUND)."""


class CommitmentMismatch(LensembleError):
    """An update is not bound to its sender's dataset commitment."""


class ProbeError(LensembleError):
    """The probe set announced by the round differs from the participant's pinned probe."""


class GaugeError(LensembleError):
    """Warm-start or sketch-consistency violation of the latent frame."""


class SketchMismatch(GaugeError):
    """An update was aligned on another sketch than the round's (INV-SKETCH-CONSISTENCY)."""


class DegenerateProcrustes(LensembleError):
    """The probe cross-covariance is too ill-conditioned for a stable alignment."""


class ConfigError(LensembleError):
    """A configuration value or key that is not acceptable; the message names the field.

    Deliberately not a ``ValueError``: pydantic would re-wrap it when it is raised while
    validating a nested section, and the field name would be lost.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class UnalignableUpdate(ConfigError):
    """An update that a coordinator-side transform (the alignment harness) must not touch:
    its metadata says it was clipped, noised, quantized, masked or otherwise transformed
    before release, where only a raw plaintext delta may be aligned there."""

    def __init__(self, reason: str, field: str = "gauge-coordinator-harness") -> None:
        super().__init__(field, reason)


class CheckpointIntegrityError(LensembleError):
    """An artifact's bytes do not hash to the digest it is known by."""


class ResidencyViolation(LensembleError):
    """Something that must stay on the participant was about to leave it."""


class StoreError(LensembleError):
    """The artifact store cannot satisfy a request (unknown digest or name, bad name)."""


class LedgerError(LensembleError):
    """The ledger's hash chain or one of its references does not verify."""


class OutcomeForgotten(LensembleError, IndexError):
    """A round outcome the coordinator no longer keeps in memory (it keeps the latest
    few); the run manifest in the store records every attempt."""


RESPONSES: Mapping[type[LensembleError], Response] = MappingProxyType(
    {
        RoundError: Response.REJECT_MESSAGE,
        # Not one bad message but participants that weigh differently: nothing to retry.
        InconsistentSizes: Response.STOP_FEDERATION,
        FaultToleranceExceeded: Response.RETRY_ROUND,
        # Shared folder: a straggler may still come, so the round is tried again; but a
        # claim is never taken over, so a claimant that died stops the run.
        RoundIncomplete: Response.RETRY_ROUND,
        ClaimantDied: Response.STOP_FEDERATION,
        SecureAggregationError: Response.RETRY_ROUND,
        # Raised only after the single re-sum also failed (modes.revealed_and_checked).
        NonDeterministicAggregation: Response.STOP_FEDERATION,
        PrivacyBudgetExceeded: Response.STOP_FEDERATION,
        CommitmentMismatch: Response.STOP_FEDERATION,
        CheckpointIntegrityError: Response.STOP_FEDERATION,
        ResidencyViolation: Response.STOP_FEDERATION,
        ProbeError: Response.REFUSE_RELEASE,
        GaugeError: Response.REFUSE_RELEASE,
        SketchMismatch: Response.REJECT_MESSAGE,
        DegenerateProcrustes: Response.REFUSE_RELEASE,
        DPBoundViolation: Response.REFUSE_RELEASE,
        ConfigError: Response.STOP_FEDERATION,
        # One sender configured otherwise (it quantized, clipped, ...): its update only.
        UnalignableUpdate: Response.REJECT_MESSAGE,
        StoreError: Response.STOP_FEDERATION,
        LedgerError: Response.STOP_FEDERATION,
    }
)


def response_to(error: BaseException) -> Response:
    """Return the response the runtime gives to ``error``.

    The most specific class listed in :data:`RESPONSES` wins. An exception that is
    not a :class:`LensembleError` (a bug, not a protocol outcome) stops the federation.
    """
    for cls in type(error).__mro__:
        if cls in RESPONSES:
            return RESPONSES[cls]  # type: ignore[index]
    return Response.STOP_FEDERATION


def _taxonomy(root: type[LensembleError] = LensembleError) -> list[type[LensembleError]]:
    return [root, *(c for sub in root.__subclasses__() for c in _taxonomy(sub))]


def reported(name: str, message: str) -> LensembleError | None:
    """The error a participant reported by name (in a Refusal), rebuilt so that the
    coordinator can look its response up in :data:`RESPONSES`; None for a name that is
    not in the taxonomy. An error whose constructor takes more than a message (e.g. one
    that carries structured fields) is rebuilt as its nearest ancestor that does not:
    the response is the same, and a participant cannot make the rebuild fail."""
    for cls in _taxonomy():
        if cls.__name__ != name:
            continue
        if cls is ConfigError:
            return ConfigError("reported by a participant", message)
        for ancestor in cls.__mro__:
            if issubclass(ancestor, LensembleError) and ancestor is not ConfigError:
                try:
                    return ancestor(message)
                except TypeError:
                    continue
    return None


def response_table() -> str:
    """The error table as markdown (error, response, what it means); used by the docs."""
    rows = ["| error | response | raised when |", "| --- | --- | --- |"]
    for cls, response in RESPONSES.items():
        summary = " ".join((cls.__doc__ or "").split("\n\n")[0].split())
        rows.append(f"| `{cls.__name__}` | {response.value} | {summary} |")
    return "\n".join(rows)
