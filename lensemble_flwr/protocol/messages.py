"""The control-plane messages, validated at ingress.

A transport carries *wire payloads*: plain mappings of JSON-like values and numpy
arrays. The receiver, never the sender's transport, turns a payload into a message
with :func:`from_wire`; anything that does not validate raises :class:`RoundError`
and the round does not move. :func:`message_digest` hashes a message in the
canonical encoding of :mod:`lensemble_flwr.canonical`.

A message's ``kind`` is a :class:`MessageKind`; on the wire (and in every hash) it is
the member's plain string value, so the wire format does not depend on the enum.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union, get_args

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from lensemble_flwr.canonical import digest_arrays, digest_record
from lensemble_flwr.errors import RoundError

WirePayload = Mapping[str, Any]
_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_MASKED_DTYPE = np.dtype(np.int64)  # a masked release: fixed-point integers mod 2**64
_WIRE_DTYPES = (*_FLOAT_DTYPES, np.dtype(np.int8), _MASKED_DTYPE)  # int8: quantized
_HEX64 = r"^[0-9a-f]{64}$"


class MessageKind(str, enum.Enum):
    """What a control message is: the ``kind`` field of its class, whose value is the
    string the wire carries."""

    ROUND_OPEN = "round-open"
    COMMITMENT = "commitment"
    UPDATE = "update"
    REFUSAL = "refusal"
    UNMASK_REQUEST = "unmask-request"
    UNMASK_RESPONSE = "unmask-response"
    ROUND_CLOSE = "round-close"
    SURVIVOR_CHECK = "survivor-check"
    SURVIVOR_ATTESTATION = "survivor-attestation"

    def __str__(self) -> str:  # "update", not "MessageKind.UPDATE", in messages and logs
        return self.value


PARTICIPANT_KINDS = frozenset(
    {
        MessageKind.COMMITMENT,
        MessageKind.UPDATE,
        MessageKind.REFUSAL,
        MessageKind.UNMASK_RESPONSE,
        MessageKind.SURVIVOR_ATTESTATION,
    }
)
"""The kinds a participant sends (about itself, and may sign); the coordinator sends the
others."""


def _validate_arrays(value: Any) -> dict[str, np.ndarray]:
    if not isinstance(value, Mapping):
        raise ValueError(f"expected a mapping of named arrays, got {type(value).__name__}")
    out: dict[str, np.ndarray] = {}
    for name in sorted(value, key=str):
        array = value[name]
        if not isinstance(name, str) or not name:
            raise ValueError(f"array names must be non-empty strings, got {name!r}")
        if not isinstance(array, np.ndarray) or isinstance(array, (np.matrix, np.ma.MaskedArray)):
            # a matrix multiplies where an array scales, a masked array hides values
            raise ValueError(f"{name}: expected a numpy array, got {type(array).__name__}")
        if array.dtype not in _WIRE_DTYPES:
            raise ValueError(f"{name}: dtype {array.dtype} is not float32, float64 or int8")
        out[name] = array
    return out


NamedArraysField = Annotated[dict[str, np.ndarray], PlainValidator(_validate_arrays)]


def released_max_abs(
    arrays: Mapping[str, np.ndarray], scales: Mapping[str, float] | None = None
) -> float:
    """Largest |released value| over all arrays (``array * scale`` for an int8 release).

    Raises:
        ValueError: naming the first array with a NaN or an infinity, or a scale that is
            not finite and positive.
    """
    largest = 0.0
    for name, array in arrays.items():
        scale = 1.0 if scales is None else scales[name]
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{name}: scale {scale} is not finite and positive")
        if array.size == 0:
            continue
        hi, lo = float(array.max()), float(array.min())
        if not (math.isfinite(hi) and math.isfinite(lo)):
            raise ValueError(f"{name}: contains NaN or infinity")
        largest = max(largest, hi * scale, -lo * scale)
    return largest


class _Message(BaseModel):
    # no NaN or infinity in any float field: canonical JSON (and the hashes and signatures
    # over it) has none, so such a message could be neither digested nor verified
    model_config = ConfigDict(
        frozen=True, extra="forbid", arbitrary_types_allowed=True, allow_inf_nan=False
    )

    run_id: str = Field(min_length=1, max_length=128)
    round: int = Field(ge=1)  # Flower's numbering: the first round is round 1
    sender: str = Field(min_length=1, max_length=128)


class RoundOpen(_Message):
    """Coordinator → participants: round ``round`` is open on this pinned global state."""

    kind: Literal[MessageKind.ROUND_OPEN] = MessageKind.ROUND_OPEN
    attempt: int = Field(1, ge=1)
    global_hash: str = Field(pattern=_HEX64)
    params: NamedArraysField
    sketch_seed: int = Field(ge=0)
    h_steps: int = Field(ge=1)
    probe_hash: str = ""
    landmark_hashes: tuple[str, ...] = ()
    needs_commitment: bool = Field(
        True,
        description="Send a Commitment: the recipient is not bound yet or, in a masked "
        "round, has no unspent mask key (the Commitment brings a fresh one).",
    )
    secagg_members: tuple[str, ...] = Field(
        (),
        description="Masked round: every member (sorted), as 'pid:mask_key:enc_key'; in a "
        "sparse graph, members that are not the recipient's neighbours as 'pid::'.",
    )
    secagg_threshold: int = Field(0, ge=0)
    secagg_prg: str = Field(
        "", max_length=32, description="Masked: the PRG the masks are drawn with."
    )
    secagg_neighbours: int = Field(
        0, ge=0, description="Masked: pairwise masks with this many neighbours (0: all)."
    )

    @model_validator(mode="after")
    def _float_params(self) -> RoundOpen:
        bad = [n for n, a in self.params.items() if a.dtype not in _FLOAT_DTYPES]
        if bad:
            raise ValueError(f"global params must be floating-point: {bad}")
        non_finite = [n for n, a in self.params.items() if not np.isfinite(a).all()]
        if non_finite:
            raise ValueError(f"global params must be finite: {non_finite}")
        return self


class _FromParticipant(_Message):
    """A message a participant sends about itself: the sender is the participant."""

    attempt: int = Field(1, ge=1)
    participant_id: str = Field(min_length=1, max_length=128)
    signature: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{16,512}$",
        description="ECDSA signature by the sender's identity key (identity/signing.py).",
    )

    @model_validator(mode="after")
    def _sender_is_participant(self) -> _FromParticipant:
        if self.sender != self.participant_id:
            raise ValueError("sender and participant_id differ")
        if (getattr(self, "endorses", None) is None) != (
            getattr(self, "endorsement", None) is None
        ):
            raise ValueError("endorses and endorsement come together (a record and its signature)")
        return self


_ENDORSES = Field(
    None,
    pattern=_HEX64,
    description="The ledger record (its record_hash) the sender checked last: the newest "
    "round it saw close (identity/endorsement.py).",
)
_ENDORSEMENT = Field(
    None,
    pattern=r"^[0-9a-f]{16,512}$",
    description="The sender's identity-key signature of ``endorses`` (an endorsement).",
)
ENDORSEMENT_FIELDS = ("endorses", "endorsement")
"""Optional fields of Commitment and Update left out of the wire payload (and so of every
digest and signature) while unset: a message without an endorsement hashes as it did
before the fields existed."""


class Commitment(_FromParticipant):
    """Participant → coordinator: I take part in this round, bound to this dataset root."""

    kind: Literal[MessageKind.COMMITMENT] = MessageKind.COMMITMENT
    dataset_root: str = Field(pattern=_HEX64)
    num_examples: int = Field(ge=1)
    mask_key: str | None = Field(None, pattern=_HEX64, description="X25519, secure sums.")
    enc_key: str | None = Field(None, pattern=_HEX64, description="X25519, sealed shares.")
    identity_key: str | None = Field(
        None,
        max_length=1024,
        description="OpenSSH ECDSA public key the sender signs with (registered at join).",
    )
    endorses: str | None = _ENDORSES
    endorsement: str | None = _ENDORSEMENT


class Update(_FromParticipant):
    """Participant → aggregator: the released pseudo-gradient, bound to the dataset root.

    ``dataset_root`` is None for an *unbound* contribution (a stock Flower ClientApp, or
    a participant that cannot commit to its data); the coordinator admits those only when
    the configuration does not require binding, and records them as unbound.
    """

    kind: Literal[MessageKind.UPDATE] = MessageKind.UPDATE
    dataset_root: str | None = Field(pattern=_HEX64)
    delta: NamedArraysField
    l2_norm: float | None = Field(
        None,
        ge=0,
        description="Plaintext only, informational: the norm of delta. A masked update "
        "never carries it (it would leak what the mask hides).",
    )
    num_examples: int = Field(ge=1)
    transforms: tuple[str, ...] = ()
    epsilon: float | None = Field(
        None, ge=0, description="The sender's cumulative epsilon after this release (DP)."
    )
    scales: dict[str, float] | None = Field(
        None, description="Per-tensor scales of an int8 release: the value is delta * scale."
    )
    masked: bool = Field(False, description="delta is a masked fixed-point release (int64).")
    sealed_shares: dict[str, str] | None = Field(
        None, description="Masked: per member, this round's self-mask share sealed for it."
    )
    next_mask_key: str | None = Field(
        None, pattern=_HEX64, description="Masked: the mask key of the sender's next round."
    )
    sketch_fingerprint: str | None = Field(
        None, pattern=_HEX64, description="Gauge alignment: fingerprint of the sketch A used."
    )
    endorses: str | None = _ENDORSES
    endorsement: str | None = _ENDORSEMENT
    _max_abs: float = PrivateAttr(0.0)

    @model_validator(mode="after")
    def _check(self) -> Update:
        if not self.delta:
            raise ValueError("delta is empty")
        int64 = {n for n, a in self.delta.items() if a.dtype == _MASKED_DTYPE}
        if self.masked:
            if int64 != set(self.delta) or self.scales is not None or not self.sealed_shares:
                raise ValueError("a masked update carries int64 arrays and sealed shares only")
            if self.l2_norm is not None:
                raise ValueError("a masked update carries no norm: it would leak")
            return self
        if int64 or self.sealed_shares is not None or self.next_mask_key is not None:
            raise ValueError("int64 arrays, sealed shares and mask keys belong to masked updates")
        int8 = {n for n, a in self.delta.items() if a.dtype == np.int8}
        if self.scales is None and int8:
            raise ValueError(f"int8 arrays {sorted(int8)} without scales")
        if self.scales is not None and (
            int8 != set(self.delta) or set(self.scales) != set(self.delta)
        ):
            raise ValueError("a quantized update needs int8 arrays and one scale for each")
        self._max_abs = released_max_abs(self.delta, self.scales)
        return self

    def scale_of(self, name: str) -> float:
        """The factor that turns ``delta[name]`` into released values (1 if unquantized)."""
        return 1.0 if self.scales is None else self.scales[name]

    @property
    def max_abs(self) -> float:
        """Largest |value| in ``delta`` (computed once, at validation)."""
        return self._max_abs


class Refusal(_FromParticipant):
    """Participant → coordinator: I release nothing this round, and why.

    Not one of the specification's four messages: it is how a participant's typed error
    (e.g. a privacy budget that a release would exceed) reaches the coordinator, so the
    round stops waiting for that participant and the error table can decide.
    """

    kind: Literal[MessageKind.REFUSAL] = MessageKind.REFUSAL
    error: str = Field(min_length=1, max_length=64, description="The error's class name.")
    reason: str = Field("", max_length=2000)


class UnmaskRequest(_Message):
    """Coordinator → surviving member of a masked round: disclose one share per sender."""

    kind: Literal[MessageKind.UNMASK_REQUEST] = MessageKind.UNMASK_REQUEST
    attempt: int = Field(1, ge=1)
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    sealed: dict[str, str] = Field(description="sender -> its shares sealed for you (hex)")
    attestations: dict[str, Annotated[str, Field(pattern=_HEX64)]] = Field(
        default_factory=dict,
        description="attester -> its attestation of this survivor set to you (hex "
        "HMAC); needed when anyone is dropped (secagg/consistency.py)",
    )


class SurvivorCheck(_Message):
    """Coordinator → surviving member of a masked round in which somebody dropped: the
    survivor set it will be asked to disclose for; attest it to the other survivors."""

    kind: Literal[MessageKind.SURVIVOR_CHECK] = MessageKind.SURVIVOR_CHECK
    attempt: int = Field(1, ge=1)
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]


class SurvivorAttestation(_FromParticipant):
    """Surviving member → coordinator: its attestation of the survivor set of the
    SurvivorCheck to each of its surviving neighbours, to be relayed to them."""

    kind: Literal[MessageKind.SURVIVOR_ATTESTATION] = MessageKind.SURVIVOR_ATTESTATION
    tags: dict[str, Annotated[str, Field(pattern=_HEX64)]] = Field(
        description="recipient -> the attestation addressed to it (hex HMAC-SHA256)"
    )


class UnmaskResponse(_FromParticipant):
    """Surviving member → coordinator: its share of each survivor's self mask, and its
    pairwise seed (of this round attempt only) with each dropped neighbour; never both
    for one sender."""

    kind: Literal[MessageKind.UNMASK_RESPONSE] = MessageKind.UNMASK_RESPONSE
    b_shares: dict[str, str] = Field(description="survivor -> 'x:y_hex'")
    pair_seeds: dict[str, Annotated[str, Field(pattern=_HEX64)]] = Field(
        description="dropped neighbour -> the pairwise seed with it (hex)"
    )

    @model_validator(mode="after")
    def _one_secret_per_sender(self) -> UnmaskResponse:
        if set(self.b_shares) & set(self.pair_seeds):
            raise ValueError("both secrets of one sender disclosed")
        return self


class RoundClose(_Message):
    """Coordinator → participants: round ``round`` closed on this new global state.

    It names the round's ledger record (``record_hash``), which lists the contributors,
    and carries only their number: every node receives the close, so a list of C ids
    would cost O(C) bytes per node and O(C^2) per round, and tell every participant who
    else took part."""

    kind: Literal[MessageKind.ROUND_CLOSE] = MessageKind.ROUND_CLOSE
    previous_hash: str = Field(pattern=_HEX64)
    global_hash: str = Field(pattern=_HEX64)
    count: int = Field(ge=0, description="C_t: how many updates the round summed.")
    record_hash: str = Field(pattern=_HEX64)


ParticipantMessage = _FromParticipant
"""Any message a participant sends about itself (and may sign)."""

ControlMessage = Union[  # noqa: UP007
    RoundOpen,
    Commitment,
    Update,
    Refusal,
    UnmaskRequest,
    UnmaskResponse,
    RoundClose,
    SurvivorCheck,
    SurvivorAttestation,
]
_MESSAGE_TYPES: tuple[type[_Message], ...] = get_args(ControlMessage)
_ADAPTER: TypeAdapter[ControlMessage] = TypeAdapter(
    Annotated[ControlMessage, Field(discriminator="kind")]
)
_ARRAY_FIELDS = ("params", "delta")


def kind_of(payload: Any) -> MessageKind | None:
    """The kind a wire payload (or a message) says it is; None when it names no kind.

    Reads the ``kind`` field only: the payload is not validated (:func:`from_wire` does).
    """
    if isinstance(payload, _MESSAGE_TYPES):
        return payload.kind
    kind = payload.get("kind") if isinstance(payload, Mapping) else None
    try:
        return MessageKind(kind) if isinstance(kind, str) else None
    except ValueError:
        return None


def to_wire(message: ControlMessage) -> dict[str, Any]:
    """The wire payload of a message (a shallow mapping; arrays are not copied). Its
    ``kind`` is the plain string (``"update"``), not the :class:`MessageKind`."""
    payload = {name: getattr(message, name) for name in type(message).model_fields}
    for name in ENDORSEMENT_FIELDS:
        if payload.get(name, 0) is None:  # unset: absent, as before the fields existed
            del payload[name]
    payload["kind"] = MessageKind(message.kind).value  # also for an unvalidated model_construct
    return payload


_SCALARS = (str, int, float, bool, type(None))
_MISSING = object()


def _immutable(value: Any) -> bool:
    """Whether ``value`` can never change: a plain scalar, or a tuple of them."""
    kind = type(value)
    return kind in _SCALARS or (kind is tuple and all(type(v) in _SCALARS for v in value))


def _same_values(held: Mapping[str, Any], raw: Mapping[str, Any]) -> bool:
    """Whether ``raw`` has exactly ``held``'s fields, each the *same object*."""
    return len(held) == len(raw) and all(raw.get(k, _MISSING) is v for k, v in held.items())


_last_validated: tuple[dict[str, Any], ControlMessage] | None = None
"""The last payload :func:`from_wire` validated whose every value is immutable (its
fields, kept alive here, and the message). A broadcast hands every recipient the same
payload object (a RoundClose to C participants in one process): it is validated once,
not C times."""


def from_wire(payload: Any) -> ControlMessage:
    """Validate a wire payload into a message.

    Validation is a pure function of the payload's values. When every value of the
    payload is the very object (a plain scalar or a tuple of them: nothing that can
    change) of the last such payload validated, the message validated then — frozen —
    is returned again; anything else is validated afresh.

    Raises:
        RoundError: the payload is not a well-formed control message; the error names
            the first offending field.
    """
    global _last_validated
    if isinstance(payload, _MESSAGE_TYPES):
        payload = to_wire(payload)
    if not isinstance(payload, Mapping):
        raise RoundError(f"malformed message: expected a mapping, got {type(payload).__name__}")
    raw = dict(payload)
    held = _last_validated
    if held is not None and _same_values(held[0], raw):
        return held[1]
    try:
        message = _ADAPTER.validate_python(raw)
        if all(_immutable(v) for v in raw.values()):
            _last_validated = (raw, message)
        return message
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "message"
        what = first["msg"]
        if first["type"] == "union_tag_invalid":  # pydantic would list the enum members' reprs
            where = "kind"
            kinds = ", ".join(kind.value for kind in MessageKind)
            what = f"{first['ctx']['tag']!s:.32} is not one of {kinds}"
        raise RoundError(
            f"malformed {payload.get('kind', 'message')!s:.32}: {where}: {what}"
        ) from None


def canonical_fields(message: ControlMessage) -> dict[str, Any]:
    """A message's fields as they are hashed: arrays by their own digest (the expensive
    part: compute this once per message and pass it on)."""
    fields: dict[str, Any] = {}
    for name, value in to_wire(message).items():
        if name in _ARRAY_FIELDS:
            fields[name] = digest_arrays(value, name)
        elif isinstance(value, tuple):
            fields[name] = list(value)
        else:
            fields[name] = value
    return fields


def message_digest(message: ControlMessage, fields: Mapping[str, Any] | None = None) -> str:
    """SHA-256 of a message in the canonical encoding (arrays by their own digest);
    ``fields``: its :func:`canonical_fields`, when already computed."""
    if fields is None:
        fields = canonical_fields(message)
    return digest_record(f"message/{MessageKind(message.kind).value}", dict(fields))
