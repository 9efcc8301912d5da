"""Dataset commitments: a SHA-256 Merkle tree over a participant's records.

Leaves and inner nodes are hashed under different domains, so a node can never be
passed off as a leaf (the second-preimage attack on naive Merkle trees). The tree
splits at the largest power of two below the number of leaves (RFC 6962), which
makes the root and inclusion proofs well defined for any number of records.

A participant's commitment is *hiding*: each leaf is salted, ``salt_i = HMAC(secret, i)``
with a 32-byte secret that never leaves the participant. Without the secret the root says
nothing about the records (two neighbouring datasets give unrelated roots); an inclusion
proof reveals one leaf's salt, which says nothing about the others. The unsalted tree
(``secret=None``) remains for tests and for data that is public anyway.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence

from lensemble_flwr.canonical import digest_bytes
from lensemble_flwr.errors import CommitmentMismatch

SECRET_BYTES = 32


def leaf_salt(secret: bytes, index: int) -> bytes:
    """The salt of leaf ``index`` under a participant's commitment secret."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a commitment secret is {SECRET_BYTES} bytes")
    return hmac.new(secret, b"lensemble-merkle-salt|%d" % index, hashlib.sha256).digest()


def leaf_hash(record: bytes, salt: bytes | None = None) -> str:
    """Hash of one record as a Merkle leaf (salted: a hiding leaf)."""
    if salt is None:
        return digest_bytes("merkle-leaf", record)
    return digest_bytes("merkle-leaf-salted", salt + record)


def _leaves(records: Iterable[bytes], secret: bytes | None) -> list[str]:
    if secret is None:
        return [leaf_hash(r) for r in records]
    return [leaf_hash(r, leaf_salt(secret, i)) for i, r in enumerate(records)]


def node_hash(left: str, right: str) -> str:
    """Hash of an inner node from its children's hex digests."""
    return digest_bytes("merkle-node", bytes.fromhex(left) + bytes.fromhex(right))


def _split(n: int) -> int:
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def _root(leaves: Sequence[str]) -> str:
    if len(leaves) == 1:
        return leaves[0]
    k = _split(len(leaves))
    return node_hash(_root(leaves[:k]), _root(leaves[k:]))


def merkle_root(records: Iterable[bytes], secret: bytes | None = None) -> str:
    """The Merkle root of ``records`` in the order given (salted under ``secret``).

    Raises:
        ValueError: there are no records (an empty dataset commits to nothing).
    """
    leaves = _leaves(records, secret)
    if not leaves:
        raise ValueError("cannot commit to an empty dataset")
    return _root(leaves)


def inclusion_proof(
    records: Sequence[bytes], index: int, secret: bytes | None = None
) -> list[str]:
    """The sibling hashes, leaf to root, that prove ``records[index]`` is in the tree."""
    return inclusion_proof_and_root(records, index, secret)[0]


def inclusion_proof_and_root(
    records: Sequence[bytes], index: int, secret: bytes | None = None
) -> tuple[list[str], str]:
    """:func:`inclusion_proof` and :func:`merkle_root` of ``records`` at once, hashing every
    leaf and inner node once (instead of twice for the two calls)."""
    if not 0 <= index < len(records):
        raise IndexError(f"record {index} of {len(records)}")
    path: list[str] = []

    def walk(nodes: Sequence[str], i: int) -> str:
        """The root of ``nodes``; appends the siblings on leaf ``i``'s way up to ``path``."""
        if len(nodes) == 1:
            return nodes[0]
        k = _split(len(nodes))
        if i < k:
            left = walk(nodes[:k], i)
            right = _root(nodes[k:])
            path.append(right)
        else:
            left = _root(nodes[:k])
            right = walk(nodes[k:], i - k)
            path.append(left)
        return node_hash(left, right)

    root = walk(_leaves(records, secret), index)
    return path, root


def verify_inclusion(
    record: bytes,
    index: int,
    size: int,
    proof: Sequence[str],
    root: str,
    salt: bytes | None = None,
) -> None:
    """Check that ``record`` (salted with ``salt``) is leaf ``index`` of a tree of
    ``size`` leaves with ``root``.

    Raises:
        CommitmentMismatch: the proof does not lead to ``root``.
    """

    def fold(i: int, n: int, h: str, siblings: list[str]) -> str:
        if n == 1:
            if siblings:
                raise CommitmentMismatch("inclusion proof is longer than the tree is deep")
            return h
        k = _split(n)
        if not siblings:
            raise CommitmentMismatch("inclusion proof is shorter than the tree is deep")
        sibling = siblings.pop()
        if i < k:
            return node_hash(fold(i, k, h, siblings), sibling)
        return node_hash(sibling, fold(i - k, n - k, h, siblings))

    if not 0 <= index < size:
        raise CommitmentMismatch(f"index {index} outside a tree of {size} records")
    if fold(index, size, leaf_hash(record, salt), list(proof)) != root:
        raise CommitmentMismatch("inclusion proof does not lead to the committed root")
