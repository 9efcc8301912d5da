"""A participant's secure-aggregation keys and what is derived from them.

Two X25519 key pairs: a mask key, whose Diffie-Hellman secrets seed the pairwise masks of
one round attempt (a fresh one every round), and a sealing key, whose secrets key the
authenticated encryption (ChaCha20-Poly1305) of the shares a participant sends to its
peers through the aggregator. Derivations are HKDF-SHA256 with a context
that names the run, the round and the attempt, so no seed is ever used twice.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from lensemble_flwr.errors import SecureAggregationError


def _raw_private(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def _raw_public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


@functools.lru_cache(maxsize=4096)
def _private(raw: bytes) -> X25519PrivateKey:
    """Parsed keys are cached: a round derives a seed per member pair from the same keys."""
    return X25519PrivateKey.from_private_bytes(raw)


@functools.lru_cache(maxsize=4096)
def _public(raw: bytes) -> X25519PublicKey:
    return X25519PublicKey.from_public_bytes(raw)


def new_private_key() -> bytes:
    """A fresh X25519 private key (raw, 32 bytes)."""
    return _raw_private(X25519PrivateKey.generate())


def public_key(private: bytes) -> bytes:
    """The raw public half of a raw X25519 private key."""
    return _raw_public(_private(private))


_PROBE = bytes(range(1, 33))  # a fixed private key, only to test a peer's public key


def hkdf(material: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF-SHA256 of ``material`` (no salt) for the purpose ``info``: ``length`` bytes."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(material)


class BoxKeys:
    """The share boxes (ChaCha20-Poly1305 keyed by HKDF of X25519) of one sealing key:
    one exchange per peer, however many shares are sealed for it or opened from it.
    The sealing key is long-lived, and so are its boxes: a participant keeps one
    ``BoxKeys`` across rounds (in memory, never on disk)."""

    def __init__(self, enc_private: bytes) -> None:
        self.enc_private = enc_private
        self._boxes: dict[bytes, ChaCha20Poly1305] = {}

    def box(self, peer_enc_public: bytes) -> ChaCha20Poly1305:
        """The box shared with the peer (the same from both sides).

        Raises:
            SecureAggregationError: the peer's key is not a usable X25519 public key.
        """
        found = self._boxes.get(peer_enc_public)
        if found is None:
            found = ChaCha20Poly1305(_box_key(self.enc_private, peer_enc_public))
            self._boxes[peer_enc_public] = found
        return found


@dataclasses.dataclass(frozen=True)
class SecAggKeys:
    """The private halves of a round's mask key and of the sealing key (raw, 32 bytes).

    Every X25519 agreement it makes is made once: its pair seeds (per peer and context)
    are kept with it, its boxes in ``boxes`` (give the participant's long-lived
    :class:`BoxKeys` to keep them across rounds)."""

    mask_private: bytes
    enc_private: bytes
    boxes: BoxKeys | None = dataclasses.field(default=None, repr=False, compare=False)
    _seeds: dict[tuple[bytes, bytes], tuple[bytes, bytes]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.boxes is None:
            object.__setattr__(self, "boxes", BoxKeys(self.enc_private))
        elif self.boxes.enc_private != self.enc_private:
            raise ValueError("the boxes belong to another sealing key")

    @classmethod
    def generate(cls) -> SecAggKeys:
        """Two fresh private keys."""
        return cls(new_private_key(), new_private_key())

    @property
    def mask_public(self) -> bytes:
        return public_key(self.mask_private)

    @property
    def enc_public(self) -> bytes:
        return public_key(self.enc_private)

    def box(self, peer_enc_public: bytes) -> ChaCha20Poly1305:
        """The share box shared with the peer (:meth:`BoxKeys.box`)."""
        assert self.boxes is not None  # __post_init__
        return self.boxes.box(peer_enc_public)

    def _agreed(self, peer_mask_public: bytes, context: bytes) -> tuple[bytes, bytes]:
        """(pair seed, attestation key) with the peer for ``context``: one X25519
        agreement, two HKDF derivations under distinct labels."""
        found = self._seeds.get((peer_mask_public, context))
        if found is None:
            secret = _exchange(self.mask_private, peer_mask_public)
            found = (hkdf(secret, PAIR_LABEL + context), hkdf(secret, ATTEST_LABEL + context))
            self._seeds[(peer_mask_public, context)] = found
        return found

    def pair_seed(self, peer_mask_public: bytes, context: bytes) -> bytes:
        """:func:`pair_seed` of the mask key with the peer's, computed once.

        Raises:
            SecureAggregationError: the peer's key is not a usable X25519 public key.
        """
        return self._agreed(peer_mask_public, context)[0]

    def attest_key(self, peer_mask_public: bytes, context: bytes) -> bytes:
        """:func:`attest_key` of the mask key with the peer's (the agreement the pair
        seed came from, made once).

        Raises:
            SecureAggregationError: the peer's key is not a usable X25519 public key.
        """
        return self._agreed(peer_mask_public, context)[1]


def _exchange(private: bytes, peer_public: bytes) -> bytes:
    """X25519, refusing a peer key that is not one (a low-order point gives no secret).

    Raises:
        SecureAggregationError: the peer's public key is malformed or of low order.
    """
    try:
        return _private(private).exchange(_public(peer_public))
    except ValueError as exc:
        raise SecureAggregationError(f"not a usable X25519 public key: {exc}") from None


def check_public_key(public: bytes) -> None:
    """Refuse a public key no exchange can use (wrong length, low order).

    Raises:
        SecureAggregationError: it is not a usable X25519 public key.
    """
    if len(public) != 32:
        raise SecureAggregationError("an X25519 public key is 32 bytes")
    _exchange(_PROBE, public)


PAIR_LABEL = b"lensemble-secagg/pair|"
ATTEST_LABEL = b"lensemble-secagg/attest|"
"""HKDF labels of the two keys one X25519 agreement of mask keys gives: the pairwise
mask seed (disclosed for a dropped neighbour) and the key that authenticates survivor
sets between the two members (never disclosed: knowing the seed says nothing of it)."""


def pair_seed(mask_private: bytes, peer_mask_public: bytes, context: bytes) -> bytes:
    """The pairwise mask seed of two participants for one round attempt (symmetric).

    Raises:
        SecureAggregationError: the peer's key is not a usable X25519 public key.
    """
    return hkdf(_exchange(mask_private, peer_mask_public), PAIR_LABEL + context)


def attest_key(mask_private: bytes, peer_mask_public: bytes, context: bytes) -> bytes:
    """The key two members authenticate survivor sets with, for one round attempt
    (symmetric; from the agreement of :func:`pair_seed`, under another label).

    Raises:
        SecureAggregationError: the peer's key is not a usable X25519 public key.
    """
    return hkdf(_exchange(mask_private, peer_mask_public), ATTEST_LABEL + context)


def _box_key(enc_private: bytes, peer_enc_public: bytes) -> bytes:
    return hkdf(_exchange(enc_private, peer_enc_public), b"lensemble-secagg/share-box")


SEALED_MIN, SEALED_MAX = 12 + 16, 12 + 16 + 512
"""A sealed share: a 12-byte nonce, the ciphertext (a share is 'x:y' in hex, at most a few
hundred bytes) and a 16-byte tag."""


def seal(enc_private: bytes, peer_enc_public: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """Encrypt ``plaintext`` for the peer (nonce || ciphertext with tag)."""
    return seal_in(ChaCha20Poly1305(_box_key(enc_private, peer_enc_public)), plaintext, aad)


def seal_in(box: ChaCha20Poly1305, plaintext: bytes, aad: bytes) -> bytes:
    """:func:`seal` with the peer's box (:meth:`BoxKeys.box`): a fresh random nonce."""
    nonce = os.urandom(12)
    return nonce + box.encrypt(nonce, plaintext, aad)


def open_sealed(enc_private: bytes, peer_enc_public: bytes, sealed: bytes, aad: bytes) -> bytes:
    """Decrypt what the peer sealed for us.

    Raises:
        SecureAggregationError: the ciphertext or its associated data was altered.
    """
    _check_sealed_size(sealed)
    return open_in(ChaCha20Poly1305(_box_key(enc_private, peer_enc_public)), sealed, aad)


def _check_sealed_size(sealed: bytes) -> None:
    if not SEALED_MIN <= len(sealed) <= SEALED_MAX:
        raise SecureAggregationError(
            f"a sealed share is {len(sealed)} bytes, not {SEALED_MIN}..{SEALED_MAX}"
        )


def open_in(box: ChaCha20Poly1305, sealed: bytes, aad: bytes) -> bytes:
    """:func:`open_sealed` with the peer's box (:meth:`BoxKeys.box`).

    Raises:
        SecureAggregationError: the size is not a sealed share's, or the ciphertext or its
            associated data was altered.
    """
    _check_sealed_size(sealed)
    try:
        return box.decrypt(sealed[:12], sealed[12:], aad)
    except InvalidTag:
        raise SecureAggregationError("a sealed share does not authenticate") from None
