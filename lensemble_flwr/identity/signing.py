"""Participant identity keys and message signatures.

Every message a participant sends about itself (Commitment, Update, Refusal,
UnmaskResponse) can be signed with its identity key. The signature covers the message's
canonical digest (arrays by their own digest, every field but the signature itself) and
the round seed s_t, under a domain tag of its own. So a signed message cannot be:

* forged for another participant — the coordinator checks it against the key that
  participant registered when it joined (its first Commitment, or an allow-list);
* moved into another round or attempt — round, attempt and s_t are signed;
* altered in flight — any field changes the digest.

Identical copies (a replay of an admitted update, an update sent twice in one round) are
caught by the coordinator's bookkeeping, not by the signature.

Keys are ECDSA over NIST P-256 (or P-384), stored in OpenSSH format: the same kind of key
Flower's SuperNode authentication accepts, so an organisation handles one kind of key
and one set of tools (``ssh-keygen -t ecdsa``). Whether the *same* key may serve both
purposes is discussed in docs/deployment.md.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from lensemble_flwr.canonical import digest_record
from lensemble_flwr.errors import ForgedMessage
from lensemble_flwr.protocol.messages import (
    ParticipantMessage,
    canonical_fields,
    message_digest,
)

_CURVES = (ec.SECP256R1, ec.SECP384R1)
_HASH = {ec.SECP256R1: hashes.SHA256, ec.SECP384R1: hashes.SHA384}


def signing_digest(
    message: ParticipantMessage, round_seed: int, fields: Mapping[str, Any] | None = None
) -> str:
    """What a signature covers: the message without its signature, and s_t.
    ``fields``: the message's :func:`canonical_fields`, when already computed."""
    unsigned = {**(canonical_fields(message) if fields is None else fields), "signature": None}
    return digest_record(
        "participant-signature",
        {"message": message_digest(message, unsigned), "round_seed": round_seed},
    )


def _curve_of(key: ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey) -> type:
    for curve in _CURVES:
        if isinstance(key.curve, curve):
            return curve
    raise ForgedMessage(f"identity keys must be NIST P-256 or P-384, not {key.curve.name}")


class IdentityKey:
    """A participant's private signing key."""

    def __init__(self, private_key: ec.EllipticCurvePrivateKey) -> None:
        if not isinstance(private_key, ec.EllipticCurvePrivateKey):
            raise ForgedMessage("an identity key must be an elliptic-curve private key")
        self._curve = _curve_of(private_key)
        self._key = private_key

    @classmethod
    def generate(cls, curve: type = ec.SECP256R1) -> IdentityKey:
        """A fresh key on ``curve`` (NIST P-256 by default)."""
        return cls(ec.generate_private_key(curve()))

    @classmethod
    def load(cls, path: str | os.PathLike[str], password: bytes | None = None) -> IdentityKey:
        """Read a private key file (OpenSSH, as ``ssh-keygen -t ecdsa`` writes, or PEM)."""
        data = Path(path).read_bytes()
        try:
            if data.lstrip().startswith(b"-----BEGIN OPENSSH"):
                key = serialization.load_ssh_private_key(data, password)
            else:
                key = serialization.load_pem_private_key(data, password)
        except (ValueError, TypeError) as exc:
            raise ForgedMessage(f"{path}: not a usable identity key: {exc}") from None
        return cls(key)  # type: ignore[arg-type]

    def private_openssh(self) -> bytes:
        """The private key in OpenSSH format, unencrypted (what :meth:`load` reads)."""
        return self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )

    @property
    def fingerprint(self) -> str:
        """A stable name of this key: the first 16 hex digits of SHA-256 of its public half."""
        return hashlib.sha256(self.public_openssh.strip().encode()).hexdigest()[:16]

    @property
    def public_openssh(self) -> str:
        """The public key as one OpenSSH line (what is registered and allow-listed)."""
        raw = self._key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        return raw.decode("ascii")

    def sign(self, message: ParticipantMessage, round_seed: int) -> ParticipantMessage:
        """A copy of ``message`` carrying this key's signature."""
        signature = self.sign_digest(bytes.fromhex(signing_digest(message, round_seed)))
        return message.model_copy(update={"signature": signature})

    def sign_digest(self, digest: bytes) -> str:
        """This key's ECDSA signature (hex) of a domain-separated digest."""
        return self._key.sign(digest, ec.ECDSA(_HASH[self._curve]())).hex()


def parse_public_key(openssh: str) -> ec.EllipticCurvePublicKey:
    """Parse a registered public key (one OpenSSH line).

    Raises:
        ForgedMessage: not an OpenSSH NIST P-256/P-384 public key.
    """
    try:
        key = serialization.load_ssh_public_key(openssh.strip().encode("ascii"))
    except (ValueError, UnicodeEncodeError, TypeError, UnsupportedAlgorithm) as exc:
        raise ForgedMessage(f"not an OpenSSH public key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ForgedMessage("identity keys must be ECDSA (NIST P-256 or P-384)")
    _curve_of(key)
    return key


def verify_signature(
    message: ParticipantMessage,
    public_key: str,
    round_seed: int,
    fields: Mapping[str, Any] | None = None,
) -> None:
    """Check ``message``'s signature against the sender's registered key (``fields``:
    the message's :func:`canonical_fields`, when already computed).

    Raises:
        ForgedMessage: unsigned, malformed, or not signed by that key for this round.
    """
    if not message.signature:
        raise ForgedMessage(f"{message.participant_id}: unsigned {message.kind}")
    digest = bytes.fromhex(signing_digest(message, round_seed, fields))
    if not digest_signed_by(public_key, digest, message.signature):
        raise ForgedMessage(
            f"{message.participant_id}: {message.kind} for round {message.round} "
            f"attempt {message.attempt} is not signed by its registered identity key"
        )


def digest_signed_by(public_key: str, digest: bytes, signature: str) -> bool:
    """Whether ``signature`` (hex) is ``public_key``'s signature of ``digest``.

    Raises:
        ForgedMessage: ``public_key`` is not an OpenSSH NIST P-256/P-384 public key.
    """
    key = parse_public_key(public_key)
    try:
        key.verify(bytes.fromhex(signature), digest, ec.ECDSA(_HASH[_curve_of(key)]()))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True
