"""strategies.array_codec gives exactly what Flower's Array(ndarray) and Array.numpy() give."""

from __future__ import annotations

import io

import numpy as np
import pytest
from flwr.app import Array

from lensemble_flwr.strategies import array_codec
from lensemble_flwr.strategies.array_codec import from_array, to_array

ARRAYS = [
    np.arange(100, dtype=np.float32),
    np.arange(12, dtype=np.float64).reshape(3, 4),
    np.array(2.5, dtype=np.float32),  # 0-d
    np.zeros((0, 3), dtype=np.float32),  # empty
    np.array([True, False, True]),
    np.arange(7, dtype=np.int64),
    np.arange(5, dtype=np.uint8),
    np.arange(6, dtype=">f4").reshape(2, 3),  # big-endian
    np.array([1 + 2j, -3j], dtype=np.complex128),
    np.ones((2, 3, 4, 5), dtype=np.float16),
    np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)),  # Fortran order
    np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],  # not contiguous
    np.array([(1, 2.0)], dtype=[("a", "<i4"), ("b", "<f8")]),  # structured
    np.array([b"ab", b"c"]),  # bytes
]


def _same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()
    assert b.flags.writeable


@pytest.mark.parametrize("array", ARRAYS, ids=lambda a: f"{a.dtype}{a.shape}")
def test_to_array_is_byte_for_byte_flowers_encoding_first_and_every_later_time(
    array: np.ndarray,
) -> None:
    flower = Array(array)
    for _ in range(3):  # the first call learns the header; the later ones use it
        ours = to_array(array)
        assert (ours.dtype, ours.shape, ours.stype, ours.data) == (
            flower.dtype,
            flower.shape,
            flower.stype,
            flower.data,
        )


@pytest.mark.parametrize("array", ARRAYS, ids=lambda a: f"{a.dtype}{a.shape}")
def test_from_array_reads_what_array_numpy_reads_as_a_fresh_writable_copy(
    array: np.ndarray,
) -> None:
    encoded = Array(array)
    for _ in range(3):
        decoded = from_array(encoded)
        _same(encoded.numpy(), decoded)
        decoded[...] = 0  # a copy: the Array's bytes are not touched
        assert encoded.data == Array(array).data


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def test_an_array_whose_header_says_otherwise_is_read_as_np_load_reads_it() -> None:
    """The Array's fields say float32 (5,), its bytes hold another header: np.load trusts
    the bytes, so the fast path must not apply, whatever it has learnt."""
    to_array(np.zeros(5, np.float32))  # the float32 (5,) header is known
    for inner in (np.arange(5, dtype=np.int32), np.arange(5, dtype=np.float32).reshape(5, 1)):
        forged = Array(dtype="float32", shape=(5,), stype="numpy.ndarray", data=_npy(inner))
        _same(forged.numpy(), from_array(forged))


def test_trailing_or_missing_bytes_are_left_to_np_load() -> None:
    good = to_array(np.arange(4, dtype=np.float32))
    longer = Array(dtype=good.dtype, shape=good.shape, stype=good.stype, data=good.data + b"\0")
    _same(longer.numpy(), from_array(longer))  # np.load ignores trailing bytes
    shorter = Array(dtype=good.dtype, shape=good.shape, stype=good.stype, data=good.data[:-1])
    with pytest.raises(ValueError):
        shorter.numpy()
    with pytest.raises(ValueError):
        from_array(shorter)


def test_an_array_of_another_serialisation_type_is_refused_as_flower_refuses_it() -> None:
    other = Array(dtype="float32", shape=(1,), stype="torch.raw", data=b"\0\0\0\0")
    with pytest.raises(TypeError, match="Unsupported serialization type"):
        from_array(other)


def test_a_wrong_learnt_header_is_never_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A header is only used after it matched Flower's own bytes: a header builder that
    got it wrong leaves every array on Flower's path."""
    monkeypatch.setattr(array_codec, "_headers", {})
    monkeypatch.setattr(array_codec, "_expected_header", lambda dtype, shape: b"\x93NUMPY-bad")
    array = np.arange(3, dtype=np.float64)
    assert to_array(array).data == Array(array).data
    _same(array, from_array(Array(array)))
    assert array_codec._headers == {}
