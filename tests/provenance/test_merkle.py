"""Tests of dataset commitments: the Merkle root and inclusion proofs."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lensemble_flwr.errors import CommitmentMismatch
from lensemble_flwr.provenance.merkle import (
    inclusion_proof,
    inclusion_proof_and_root,
    leaf_hash,
    merkle_root,
    node_hash,
    verify_inclusion,
)


def _records(n: int) -> list[bytes]:
    return [f"record-{i}".encode() for i in range(n)]


def _reference_root(records: list[bytes]) -> bytes:
    """RFC 6962 Merkle tree hash, written independently with hashlib."""

    def h(domain: bytes, data: bytes) -> bytes:
        return hashlib.sha256(b"lensemble-flwr/1/" + domain + b"\x00" + data).digest()

    if len(records) == 1:
        return h(b"merkle-leaf", records[0])
    k = 1
    while k * 2 < len(records):
        k *= 2
    return h(b"merkle-node", _reference_root(records[:k]) + _reference_root(records[k:]))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17])
def test_root_matches_an_independent_rfc6962_reference(n: int) -> None:
    records = _records(n)
    assert merkle_root(records) == _reference_root(records).hex()


def test_single_record_root_is_its_leaf_hash() -> None:
    assert merkle_root([b"only"]) == leaf_hash(b"only")


def test_root_changes_with_any_record() -> None:
    records = _records(9)
    root = merkle_root(records)
    for i in range(len(records)):
        changed = list(records)
        changed[i] = changed[i] + b"!"
        assert merkle_root(changed) != root, i


def test_root_changes_with_order_and_count() -> None:
    records = _records(6)
    root = merkle_root(records)
    for i in range(len(records) - 1):
        swapped = list(records)
        swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
        assert merkle_root(swapped) != root, i
    assert merkle_root(records[:-1]) != root
    assert merkle_root([*records, records[-1]]) != root  # duplicating the last leaf


def test_root_accepts_any_iterable() -> None:
    records = _records(5)
    assert merkle_root(iter(records)) == merkle_root(records)


def test_leaf_and_node_are_domain_separated() -> None:
    a, b = b"left", b"right"
    root = merkle_root([a, b])
    assert root == node_hash(leaf_hash(a), leaf_hash(b))
    concatenated = bytes.fromhex(leaf_hash(a)) + bytes.fromhex(leaf_hash(b))
    # A one-record dataset made of the two child hashes must not share the root.
    assert leaf_hash(concatenated) != root
    assert merkle_root([concatenated]) != root


def test_empty_dataset_is_refused() -> None:
    with pytest.raises(ValueError, match="empty dataset"):
        merkle_root([])


@pytest.mark.parametrize("n", range(1, 18))
def test_every_inclusion_proof_verifies(n: int) -> None:
    records = _records(n)
    root = merkle_root(records)
    for i, record in enumerate(records):
        proof = inclusion_proof(records, i)
        assert len(proof) <= max(1, (n - 1).bit_length())
        verify_inclusion(record, i, n, proof, root)  # does not raise


@settings(max_examples=60, deadline=None)
@given(
    records=st.lists(st.binary(max_size=12), min_size=1, max_size=17, unique=True),
    data=st.data(),
)
def test_inclusion_proofs_hypothesis(records: list[bytes], data: st.DataObject) -> None:
    n = len(records)
    root = merkle_root(records)
    i = data.draw(st.integers(0, n - 1), label="index")
    proof = inclusion_proof(records, i)
    verify_inclusion(records[i], i, n, proof, root)
    wrong = data.draw(st.binary(max_size=12).filter(lambda r: r != records[i]), label="wrong")
    with pytest.raises(CommitmentMismatch):
        verify_inclusion(wrong, i, n, proof, root)
    if n > 1:
        j = (i + data.draw(st.integers(1, n - 1), label="index offset")) % n
        with pytest.raises(CommitmentMismatch):
            verify_inclusion(records[i], j, n, proof, root)


@pytest.mark.parametrize("n", [2, 3, 5, 8, 13, 17])
def test_wrong_record_index_root_or_proof_is_refused(n: int) -> None:
    records = _records(n)
    root = merkle_root(records)
    other_root = merkle_root(_records(n + 1))
    for i, record in enumerate(records):
        proof = inclusion_proof(records, i)
        with pytest.raises(CommitmentMismatch, match="does not lead to the committed root"):
            verify_inclusion(b"forged", i, n, proof, root)
        with pytest.raises(CommitmentMismatch, match="does not lead to the committed root"):
            verify_inclusion(record, i, n, proof, other_root)
        for j in range(n):
            if j != i:
                with pytest.raises(CommitmentMismatch):
                    verify_inclusion(record, j, n, proof, root)
        with pytest.raises(CommitmentMismatch, match="shorter"):
            verify_inclusion(record, i, n, proof[:-1], root)
        with pytest.raises(CommitmentMismatch, match="longer"):
            verify_inclusion(record, i, n, [*proof, proof[0]], root)
        tampered = [leaf_hash(b"x"), *proof[1:]]
        with pytest.raises(CommitmentMismatch):
            verify_inclusion(record, i, n, tampered, root)


def test_index_outside_the_tree_is_refused() -> None:
    records = _records(4)
    root = merkle_root(records)
    proof = inclusion_proof(records, 3)
    with pytest.raises(CommitmentMismatch, match="outside a tree of 4"):
        verify_inclusion(records[3], 4, 4, proof, root)
    with pytest.raises(CommitmentMismatch, match="outside"):
        verify_inclusion(records[0], -1, 4, proof, root)
    with pytest.raises(IndexError):
        inclusion_proof(records, 4)


def test_proof_for_one_record_is_empty_and_size_matters() -> None:
    assert inclusion_proof([b"a"], 0) == []
    verify_inclusion(b"a", 0, 1, [], leaf_hash(b"a"))
    records = _records(3)
    proof = inclusion_proof(records, 0)
    with pytest.raises(CommitmentMismatch):
        verify_inclusion(records[0], 0, 5, proof, merkle_root(records))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
def test_proof_and_root_at_once_are_the_two_calls(n: int) -> None:
    records = _records(n)
    for i in range(n):
        path, root = inclusion_proof_and_root(records, i)
        assert root == merkle_root(records) == _reference_root(records).hex()
        assert path == inclusion_proof(records, i)
        verify_inclusion(records[i], i, n, path, root)
    with pytest.raises(IndexError):
        inclusion_proof_and_root(records, n)
