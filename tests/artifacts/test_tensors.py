"""artifacts.tensors: the one safetensors-with-a-JSON-description format."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save as st_save

from lensemble_flwr.artifacts.checkpoint import decode_checkpoint, encode_checkpoint
from lensemble_flwr.artifacts.tensors import META_KEY, pack, unpack
from lensemble_flwr.canonical import canonical_json

TENSORS = {
    "b": np.array([1.5, -2.0]),
    "w": np.arange(6, dtype=np.float32).reshape(2, 3),
}


def test_what_is_packed_unpacks() -> None:
    tensors, meta = unpack(pack(TENSORS, {"round": 4, "names": ["b", "w"]}))
    assert meta == {"round": 4, "names": ["b", "w"]}
    assert sorted(tensors) == ["b", "w"]
    for name, array in TENSORS.items():
        assert tensors[name].dtype == array.dtype
        np.testing.assert_array_equal(tensors[name], array)


def test_the_bytes_are_one_canonical_json_entry_whatever_the_key_order() -> None:
    """Checkpoints are content-addressed: the bytes must not depend on dict order, and
    they are exactly what checkpoints and folder records were written as before."""
    a = pack(TENSORS, {"x": 1, "a": {"z": 2, "b": 3}})
    b = pack(TENSORS, {"a": {"b": 3, "z": 2}, "x": 1})
    meta = canonical_json({"a": {"b": 3, "z": 2}, "x": 1}).decode("ascii")
    assert a == b == st_save(dict(TENSORS), metadata={META_KEY: meta})


def test_a_checkpoint_is_packed() -> None:
    data = encode_checkpoint(2, TENSORS, {"w": np.zeros((2, 3), np.float32)})
    tensors, meta = unpack(data)
    assert meta["format"] == "lensemble-checkpoint/1" and meta["round"] == 2
    assert decode_checkpoint(data).round == 2
    assert sorted(tensors) == ["momentum/w", "params/b", "params/w"]


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not safetensors at all",
        st_save(dict(TENSORS)),  # no metadata
        st_save(dict(TENSORS), metadata={"other": "{}"}),  # not ours
        st_save(dict(TENSORS), metadata={META_KEY: "{not json"}),
    ],
)
def test_bytes_without_a_description_are_refused(data: bytes) -> None:
    with pytest.raises(ValueError, match="not lensemble safetensors bytes"):
        unpack(data)


def test_a_description_that_is_not_a_json_object_is_refused() -> None:
    with pytest.raises(ValueError, match="not a JSON object"):
        unpack(st_save(dict(TENSORS), metadata={META_KEY: "[1, 2]"}))
