"""Dataset commitments: a SHA-256 Merkle tree over a participant's records.

Leaves and inner nodes are hashed under different domains, so a node can never be
passed off as a leaf (the second-preimage attack on naive Merkle trees). The tree
splits at the largest power of two below the number of leaves (RFC 6962), which
makes the root and inclusion proofs well defined for any number of records.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from lensemble_flwr.canonical import digest_bytes
from lensemble_flwr.errors import CommitmentMismatch


def leaf_hash(record: bytes) -> str:
    """Hash of one record as a Merkle leaf."""
    return digest_bytes("merkle-leaf", record)


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


def merkle_root(records: Iterable[bytes]) -> str:
    """The Merkle root of ``records`` in the order given.

    Raises:
        ValueError: there are no records (an empty dataset commits to nothing).
    """
    leaves = [leaf_hash(r) for r in records]
    if not leaves:
        raise ValueError("cannot commit to an empty dataset")
    return _root(leaves)


def inclusion_proof(records: Sequence[bytes], index: int) -> list[str]:
    """The sibling hashes, leaf to root, that prove ``records[index]`` is in the tree."""
    return inclusion_proof_and_root(records, index)[0]


def inclusion_proof_and_root(records: Sequence[bytes], index: int) -> tuple[list[str], str]:
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

    root = walk([leaf_hash(r) for r in records], index)
    return path, root


def verify_inclusion(record: bytes, index: int, size: int, proof: Sequence[str], root: str) -> None:
    """Check that ``record`` is leaf ``index`` of a tree of ``size`` leaves with ``root``.

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
    if fold(index, size, leaf_hash(record), list(proof)) != root:
        raise CommitmentMismatch("inclusion proof does not lead to the committed root")
