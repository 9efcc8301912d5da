"""Tests of the canonical byte encoding and the digests built on it."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from lensemble_flwr.canonical import (
    arrays_header,
    canonical_json,
    derive_seed,
    digest_arrays,
    digest_bytes,
    digest_record,
    little_endian,
)


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((3, 4)).astype(np.float32),
        "b": rng.standard_normal(4).astype(np.float32),
        "z": np.arange(6, dtype=np.float64).reshape(2, 3),
    }


def test_digest_bytes_matches_the_documented_encoding() -> None:
    expected = hashlib.sha256(b"lensemble-flwr/1/dom\x00payload").hexdigest()
    assert digest_bytes("dom", b"payload") == expected
    assert len(expected) == 64 and expected == expected.lower()


def test_digest_arrays_is_independent_of_insertion_order() -> None:
    a = _arrays()
    reordered = {name: a[name] for name in reversed(list(a))}
    assert list(reordered) != list(a)
    assert digest_arrays(reordered) == digest_arrays(a)


def test_digest_arrays_is_sensitive_to_name() -> None:
    a = _arrays()
    renamed = dict(a)
    renamed["w2"] = renamed.pop("w")
    assert digest_arrays(renamed) != digest_arrays(a)


def test_digest_arrays_is_sensitive_to_dtype_with_equal_values() -> None:
    a = {"x": np.arange(4, dtype=np.float32)}
    b = {"x": np.arange(4, dtype=np.float64)}
    c = {"x": np.arange(4, dtype=np.int32)}  # same byte length as float32
    assert len({digest_arrays(a), digest_arrays(b), digest_arrays(c)}) == 3


def test_digest_arrays_is_sensitive_to_shape_with_same_bytes() -> None:
    flat = np.arange(6, dtype=np.float32)
    assert digest_arrays({"x": flat}) != digest_arrays({"x": flat.reshape(2, 3)})
    assert digest_arrays({"x": flat.reshape(2, 3)}) != digest_arrays({"x": flat.reshape(3, 2)})


def test_digest_arrays_is_sensitive_to_a_single_value() -> None:
    a = _arrays()
    base = digest_arrays(a)
    for name in a:
        changed = {k: v.copy() for k, v in a.items()}
        flat = changed[name].reshape(-1)
        flat[-1] = np.nextafter(flat[-1], np.inf)  # one ulp in one element
        assert digest_arrays(changed) != base, name


def test_array_boundaries_are_in_the_header() -> None:
    # The same concatenated bytes split differently between two arrays.
    data = np.arange(4, dtype=np.float32)
    one = {"a": data[:1], "b": data[1:]}
    two = {"a": data[:2], "b": data[2:]}
    assert digest_arrays(one) != digest_arrays(two)


def test_domain_separation() -> None:
    a = _arrays()
    assert digest_arrays(a, "params") != digest_arrays(a, "delta")
    assert digest_arrays(a) == digest_arrays(a, "arrays")
    assert digest_bytes("x", b"same") != digest_bytes("y", b"same")
    assert digest_record("x", {"k": 1}) != digest_record("y", {"k": 1})
    # the separator keeps domain and body apart: ("ab", "c") is not ("a", "bc")
    assert digest_bytes("ab", b"c") != digest_bytes("a", b"bc")


def test_big_endian_input_hashes_like_little_endian() -> None:
    a = _arrays()
    big = {name: v.astype(v.dtype.newbyteorder(">")) for name, v in a.items()}
    assert all(v.dtype.byteorder == ">" for v in big.values())
    np.testing.assert_array_equal(big["w"], a["w"])
    assert digest_arrays(big) == digest_arrays(a)
    assert arrays_header(big) == arrays_header(a)
    assert arrays_header(a)[0][1] == "<f4"


def test_non_contiguous_input_hashes_like_its_contiguous_copy() -> None:
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    strided = base.T  # Fortran order view
    assert not strided.flags.c_contiguous
    assert digest_arrays({"x": strided}) == digest_arrays({"x": np.ascontiguousarray(strided)})
    le = little_endian(strided)
    assert le.flags.c_contiguous
    np.testing.assert_array_equal(le, strided)


def test_canonical_json_is_sorted_compact_ascii_and_refuses_nan() -> None:
    assert canonical_json({"b": 1, "a": [1, "é"]}) == b'{"a":[1,"\\u00e9"],"b":1}'
    assert digest_record("d", {"a": 1, "b": 2}) == digest_record("d", {"b": 2, "a": 1})
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})
    with pytest.raises(ValueError):
        canonical_json([float("inf")])


def test_derive_seed_is_deterministic_and_label_sensitive() -> None:
    s = derive_seed(7, "round", 3)
    assert s == derive_seed(7, "round", 3)
    assert 0 <= s < 2**63
    others = {
        derive_seed(8, "round", 3),
        derive_seed(7, "round", 4),
        derive_seed(7, "rounds", 3),
        derive_seed(7, "round", "3"),
        derive_seed(7, 3, "round"),
        derive_seed(7, "round"),
        derive_seed(7, "round", 3, "x"),
    }
    assert s not in others
    assert len(others) == 7


def test_derive_seed_is_pinned() -> None:
    # Changing the encoding would silently change every round seed of every run.
    expected = int(digest_record("seed", [7, "round", 3])[:16], 16) >> 1
    assert derive_seed(7, "round", 3) == expected
    raw = hashlib.sha256(b'lensemble-flwr/1/seed\x00[7,"round",3]').hexdigest()
    assert derive_seed(7, "round", 3) == int(raw[:16], 16) >> 1


def test_zero_size_arrays_hash_and_their_shape_counts() -> None:
    # A zero-size tensor is a legal parameter; it has no bytes but its shape is hashed.
    empty_rows = {"x": np.zeros((0, 3), np.float32)}
    empty_cols = {"x": np.zeros((3, 0), np.float32)}
    digests = {digest_arrays(empty_rows), digest_arrays(empty_cols), digest_arrays({})}
    assert len(digests) == 3
    with_scalar = {"s": np.array(2.0, np.float32), **empty_rows}
    assert digest_arrays(with_scalar) != digest_arrays(
        {"s": np.array(3.0, np.float32), **empty_rows}
    )


def test_digest_arrays_matches_the_documented_encoding() -> None:
    arrays = {"b": np.array([1.0, -2.0], np.float32), "a": np.array([[3]], np.int16)}
    header = b'[["a","<i2",[1,1]],["b","<f4",[2]]]'
    body = (
        len(header).to_bytes(8, "big")
        + header
        + np.array([[3]], "<i2").tobytes()
        + np.array([1.0, -2.0], "<f4").tobytes()
    )
    expected = hashlib.sha256(b"lensemble-flwr/1/params\x00" + body).hexdigest()
    assert digest_arrays(arrays, "params") == expected


def test_a_seeded_sample_depends_on_the_seed_not_on_the_order_of_the_items() -> None:
    from lensemble_flwr.canonical import seeded_sample

    items = [f"p{i:02d}" for i in range(20)]
    first = seeded_sample(items, 5, seed=3, domain="sample")
    assert len(first) == 5 and first == sorted(first) and set(first) <= set(items)
    assert seeded_sample(list(reversed(items)), 5, seed=3, domain="sample") == first
    assert seeded_sample(items, 5, seed=4, domain="sample") != first
    assert seeded_sample(items, 5, seed=3, domain="evaluate-sample") != first
    assert seeded_sample(items, 99, seed=3, domain="sample") == sorted(items)
    assert seeded_sample(items, -1, seed=3, domain="sample") == []
