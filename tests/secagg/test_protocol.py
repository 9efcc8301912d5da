"""Secure aggregation primitives and roles: exact cancellation, dropouts, refusals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lensemble_flwr.errors import SecureAggregationError
from lensemble_flwr.secagg import prg, shamir
from lensemble_flwr.secagg.keys import SecAggKeys, open_sealed, pair_seed, seal
from lensemble_flwr.secagg.protocol import (
    MaskedSum,
    Member,
    context_of,
    disclose,
    isolated_survivors,
    mask,
    neighbours,
    short_of_shares,
)

CONTEXT = context_of("run", 3, 1)


def federation(n: int) -> tuple[dict[str, SecAggKeys], list[Member]]:
    keys = {f"p{i}": SecAggKeys.generate() for i in range(n)}
    members = [Member(pid, k.mask_public, k.enc_public) for pid, k in keys.items()]
    return keys, members


def secure_sum(
    values: dict[str, dict[str, np.ndarray]],
    *,
    n: int,
    threshold: int,
    send: set[str],
    answer: set[str],
    degree: int = 0,
) -> tuple[dict[str, np.ndarray], MaskedSum]:
    """Run both roles: every member masks, only ``send`` deliver, only ``answer`` disclose."""
    keys, members = federation(n)
    template = next(iter(values.values()))
    releases = {
        pid: mask(
            values[pid],
            me=pid,
            keys=keys[pid],
            members=members,
            threshold=threshold,
            context=CONTEXT,
            degree=degree,
        )
        for pid in keys
    }
    aggregator = MaskedSum(template, members, threshold=threshold, context=CONTEXT, degree=degree)
    for pid in sorted(send):  # the others drop before their masked input arrives
        aggregator.add(pid, releases[pid].masked)
    disclosures = {
        holder: disclose(
            me=holder,
            keys=keys[holder],
            members=members,
            context=CONTEXT,
            survivors=aggregator.survivors,
            dropped=aggregator.dropped,
            self_mask_shares={
                s: releases[s].sealed[holder]
                for s in aggregator.survivors
                if holder in releases[s].sealed  # sparse: its neighbours' only
            },
            threshold=threshold,
            degree=degree,
        )
        for holder in sorted(answer)
    }
    return aggregator.reveal(disclosures), aggregator


def random_values(n: int, seed: int) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {
        f"p{i}": {
            "a": rng.integers(-(2**62), 2**62, (3, 4), dtype=np.int64),
            "b": rng.integers(-(2**62), 2**62, 5, dtype=np.int64),
        }
        for i in range(n)
    }


def plain_sum(values: dict[str, dict[str, np.ndarray]], who: set[str]) -> dict[str, np.ndarray]:
    out = {}
    with np.errstate(over="ignore"):
        for name in ("a", "b"):
            out[name] = sum(
                (values[p][name] for p in sorted(who)), np.zeros_like(values["p0"][name])
            )
    return out


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 6), seed=st.integers(0, 2**32))
def test_masks_cancel_exactly_without_dropouts(n: int, seed: int) -> None:
    values = random_values(n, seed)
    everyone = set(values)
    revealed, _ = secure_sum(values, n=n, threshold=max(1, n - 1), send=everyone, answer=everyone)
    expected = plain_sum(values, everyone)
    for name in expected:
        np.testing.assert_array_equal(revealed[name], expected[name])


@settings(max_examples=15, deadline=None)
@given(n=st.integers(3, 6), seed=st.integers(0, 2**32), data=st.data())
def test_the_revealed_sum_is_exact_with_dropouts_up_to_the_threshold(
    n: int, seed: int, data: st.DataObject
) -> None:
    threshold = data.draw(st.integers(2, n))
    values = random_values(n, seed)
    drop = data.draw(st.sets(st.sampled_from(sorted(values)), max_size=n - threshold))
    survivors = set(values) - drop
    revealed, aggregator = secure_sum(
        values, n=n, threshold=threshold, send=survivors, answer=survivors
    )
    assert sorted(aggregator.dropped) == sorted(drop)
    expected = plain_sum(values, survivors)
    for name in expected:
        np.testing.assert_array_equal(revealed[name], expected[name])


def test_too_few_survivors_is_a_secure_aggregation_error() -> None:
    values = random_values(4, 0)
    with pytest.raises(SecureAggregationError, match="threshold"):
        secure_sum(values, n=4, threshold=3, send={"p0", "p1"}, answer={"p0", "p1"})


def test_too_few_disclosures_cannot_reveal() -> None:
    values = random_values(4, 1)
    with pytest.raises(SecureAggregationError, match="shares"):
        secure_sum(values, n=4, threshold=3, send=set(values), answer={"p0", "p1"})


@pytest.mark.parametrize(
    ("survivors", "dropped", "match"),
    [
        (["p0", "p1", "p2"], ["p2"], "both shares"),
        (["p0", "p1"], [], "are not the members"),  # p2 is neither: hidden from the check
        (["p0", "p1", "p2", "x"], [], "are not the members"),  # a stranger
        (["p0", "p1", "p1"], ["p2"], "are not the members"),  # a survivor twice
        (["p1", "p2"], ["p0"], "not named a survivor"),  # asked as a dropped member
    ],
)
def test_a_member_discloses_only_for_a_consistent_request(
    survivors: list[str], dropped: list[str], match: str
) -> None:
    keys, members = federation(3)
    with pytest.raises(SecureAggregationError, match=match):
        disclose(
            me="p0",
            keys=keys["p0"],
            members=members,
            context=CONTEXT,
            survivors=survivors,
            dropped=dropped,
            self_mask_shares={},
            threshold=2,
        )


def test_a_survivor_next_to_a_dropped_member_must_answer_or_nothing_is_revealed() -> None:
    values = random_values(5, 4)
    survivors = {"p0", "p1", "p2", "p3"}  # p4 dropped; p3 then does not answer
    with pytest.raises(SecureAggregationError, match="p3 did not disclose its pairwise seed"):
        secure_sum(values, n=5, threshold=3, send=survivors, answer={"p0", "p1", "p2"})
    # with nobody dropped, self masks need only the threshold of answers
    revealed, _ = secure_sum(values, n=5, threshold=3, send=set(values), answer={"p0", "p1", "p2"})
    expected = plain_sum(values, set(values))
    for name in expected:
        np.testing.assert_array_equal(revealed[name], expected[name])


def test_a_masked_input_hides_the_value_and_changes_every_time() -> None:
    keys, members = federation(3)
    value = {"a": np.zeros(1000, np.int64)}
    first = mask(value, me="p0", keys=keys["p0"], members=members, threshold=2, context=CONTEXT)
    again = mask(value, me="p0", keys=keys["p0"], members=members, threshold=2, context=CONTEXT)
    assert np.count_nonzero(first.masked["a"]) > 990  # zeros do not show through
    assert not np.array_equal(first.masked["a"], again.masked["a"])  # fresh self mask


def test_sealed_shares_do_not_open_with_the_wrong_context() -> None:
    alice, bob = SecAggKeys.generate(), SecAggKeys.generate()
    sealed = seal(alice.enc_private, bob.enc_public, b"share", b"ctx")
    assert open_sealed(bob.enc_private, alice.enc_public, sealed, b"ctx") == b"share"
    with pytest.raises(SecureAggregationError, match="authenticate"):
        open_sealed(bob.enc_private, alice.enc_public, sealed, b"another round")


def test_pair_seeds_agree_and_depend_on_the_round() -> None:
    alice, bob = SecAggKeys.generate(), SecAggKeys.generate()
    ab = pair_seed(alice.mask_private, bob.mask_public, CONTEXT)
    assert ab == pair_seed(bob.mask_private, alice.mask_public, CONTEXT)
    assert ab != pair_seed(alice.mask_private, bob.mask_public, context_of("run", 4, 1))


def test_prg_is_a_function_of_its_seed_only() -> None:
    seed = bytes(range(32))
    np.testing.assert_array_equal(prg.expand(seed, 100), prg.expand(seed, 100))
    assert not np.array_equal(prg.expand(seed, 100), prg.expand(bytes(32), 100))
    with pytest.raises(ValueError):
        prg.expand(b"short", 10)


@settings(max_examples=30, deadline=None)
@given(secret=st.binary(min_size=32, max_size=32), n=st.integers(1, 7), data=st.data())
def test_any_threshold_shares_recover_the_secret(
    secret: bytes, n: int, data: st.DataObject
) -> None:
    threshold = data.draw(st.integers(1, n))
    shares = shamir.split(secret, threshold, n)
    subset = data.draw(st.permutations(shares))[:threshold]
    assert shamir.combine(subset, threshold) == secret
    if threshold > 1:
        with pytest.raises(SecureAggregationError):
            shamir.combine(subset[: threshold - 1], threshold)


@pytest.mark.parametrize(
    "size", [3 * (1 << 15) + 17, 5 * (1 << 16) + 123], ids=["one range", "split between threads"]
)
def test_add_streams_adds_exactly_the_expanded_words(size: int) -> None:
    seed = bytes(range(32))
    acc = np.arange(size, dtype=np.int64)
    prg.add_streams([(seed, +1)], acc)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(acc, np.arange(size, dtype=np.int64) + prg.expand(seed, size))
    prg.add_streams([(seed, -1)], acc)
    np.testing.assert_array_equal(acc, np.arange(size, dtype=np.int64))
    out = np.full(size, 7, np.int64)  # with a base, the accumulator's contents are not read
    prg.add_streams([(seed, +1), (seed, -1)], out, base=np.arange(size, dtype=np.int64))
    np.testing.assert_array_equal(out, np.arange(size, dtype=np.int64))


def test_masking_leaves_the_values_alone() -> None:
    keys, members = federation(3)
    values = {"w": np.arange(10, dtype=np.int64)}
    mask(values, me="p0", keys=keys["p0"], members=members, threshold=2, context=CONTEXT)
    np.testing.assert_array_equal(values["w"], np.arange(10, dtype=np.int64))


def test_a_masked_input_of_another_layout_is_refused_and_changes_nothing() -> None:
    _keys, members = federation(3)
    template = {"a": np.zeros((3, 4), np.int64), "b": np.zeros(5, np.int64)}
    aggregator = MaskedSum(template, members, threshold=2, context=CONTEXT)
    good = {"a": np.ones((3, 4), np.int64), "b": np.ones(5, np.int64)}
    for bad in (
        {"a": np.ones((4, 3), np.int64), "b": np.ones(5, np.int64)},  # same size, other shape
        {"a": np.ones((3, 4), np.int64)},  # a name missing
        {**good, "c": np.ones(1, np.int64)},  # a name too many
    ):
        with pytest.raises(SecureAggregationError, match="wrong layout"):
            aggregator.add("p0", bad)
    assert aggregator.survivors == []
    aggregator.add("p0", good)
    assert aggregator.survivors == ["p0"]


# -- the sparse (SecAgg+) neighbour graph ---------------------------------------------
@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 12), degree=st.sampled_from([0, 2, 4, 6]), ctx=st.binary(max_size=8))
def test_the_neighbour_graph_is_symmetric_with_the_asked_degree(
    n: int, degree: int, ctx: bytes
) -> None:
    _keys, members = federation(n)
    graph = {m.pid: neighbours(m.pid, members, degree, ctx) for m in members}
    for pid, near in graph.items():
        assert pid not in near
        assert len(near) == (n - 1 if degree == 0 or degree >= n - 1 else degree)
        assert all(pid in graph[other] for other in near)  # symmetric


def test_the_ring_is_reshuffled_every_round_attempt() -> None:
    _keys, members = federation(12)
    rings = {tuple(neighbours("p0", members, 2, context_of("run", r, 1))) for r in range(8)}
    assert len(rings) > 1


@settings(max_examples=15, deadline=None)
@given(n=st.integers(5, 9), seed=st.integers(0, 2**32), data=st.data())
def test_a_sparse_graph_reveals_the_exact_sum_with_dropouts(
    n: int, seed: int, data: st.DataObject
) -> None:
    threshold, degree = n - 2, 4
    values = random_values(n, seed)
    drop = data.draw(st.sets(st.sampled_from(sorted(values)), max_size=2))
    survivors = set(values) - drop
    _keys, members = federation(n)
    if short_of_shares(members, sorted(survivors), degree, threshold, CONTEXT):
        return  # the refusal has its own test
    revealed, _ = secure_sum(
        values, n=n, threshold=threshold, send=survivors, answer=survivors, degree=degree
    )
    expected = plain_sum(values, survivors)
    for name in expected:
        np.testing.assert_array_equal(revealed[name], expected[name])


def test_a_survivor_left_without_a_surviving_neighbour_is_never_exposed() -> None:
    n, degree = 8, 2
    values = random_values(n, 3)
    _keys, members = federation(n)
    target = "p0"
    drop = set(neighbours(target, members, degree, CONTEXT))  # both of p0's neighbours
    survivors = set(values) - drop
    assert isolated_survivors(members, sorted(survivors), degree, CONTEXT) == [target]
    with pytest.raises(SecureAggregationError, match="no surviving neighbour"):
        secure_sum(values, n=n, threshold=4, send=survivors, answer=set(), degree=degree)
    with pytest.raises(SecureAggregationError, match="no surviving neighbour"):
        secure_sum(values, n=n, threshold=4, send=survivors, answer=survivors, degree=degree)


def test_the_prg_is_aes_256_in_counter_mode_from_a_zero_block() -> None:
    """Word i of ``expand`` is the little-endian int64 of bytes 8i..8i+7 of the stream
    E_k(0) || E_k(1) || ... (E: AES-256 under the seed; the counter a 128-bit big-endian
    block from 0), built here from single-block ECB encryptions."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    seed = bytes(range(32))
    blocks = Cipher(algorithms.AES(seed), modes.ECB()).encryptor()
    stream = b"".join(blocks.update(i.to_bytes(16, "big")) for i in range(5))
    expected = np.frombuffer(stream, "<i8")
    np.testing.assert_array_equal(prg.expand(seed, 10), expected)
    acc = np.zeros(10, np.int64)
    prg.add_streams([(seed, +1)], acc)
    np.testing.assert_array_equal(acc, expected)
    with pytest.raises(ValueError, match="32 bytes"):
        prg.add_streams([(seed[:16], +1)], acc)
    np.testing.assert_array_equal(acc, expected)  # a refused stream changes nothing
