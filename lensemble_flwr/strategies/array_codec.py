"""numpy arrays to and from Flower ``Array``s without writing and parsing a header per array.

Flower's ``Array(ndarray)`` runs ``np.save`` and ``Array.numpy()`` runs ``np.load``. For the
small arrays a participant sends and keeps (an update, its optimizer moments), writing the
``.npy`` header and parsing it back (``np.load`` reads it with ``ast.literal_eval``) costs
several times more than copying the data. :func:`to_array` and :func:`from_array` give
exactly what those two give, byte for byte and value for value, with the header built once
per (dtype, shape):

* a header is only used once it has been seen to be the very bytes ``np.save`` writes for
  that dtype and shape (checked against Flower's own encoding the first time);
* :func:`from_array` takes the fast path only when the Array's bytes are that header
  followed by exactly the data of its dtype and shape; any other Array (another header,
  trailing bytes, Fortran order, another ``stype``) goes through ``Array.numpy()``, so
  nothing is read that ``np.load`` would refuse or read differently;
* :func:`to_array` takes it only for C-contiguous base-class arrays of a plain numeric or
  boolean dtype; anything else goes through ``Array(ndarray)``.
"""

from __future__ import annotations

import io
import math
import threading

import numpy as np
from flwr.app import Array
from flwr.common.constant import SType

_KINDS = frozenset("biufc")  # bool, integers, floats, complex: what np.save writes raw
_MAX_HEADERS = 4096
_headers: dict[tuple[np.dtype, tuple[int, ...]], bytes] = {}
_lock = threading.Lock()


def _expected_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes | None:
    """The version 1.0 ``.npy`` header of a C-order array (None if it needs another)."""
    buffer = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False}
    try:
        np.lib.format.write_array_header_1_0(buffer, {**header, "shape": shape})
    except ValueError:  # too long for version 1.0: np.save writes another version
        return None
    return buffer.getvalue()


def _learn(dtype: np.dtype, shape: tuple[int, ...], data: bytes, raw: bytes) -> None:
    """Remember the header of (dtype, shape) if ``data`` (what np.save wrote) is exactly it
    followed by ``raw`` (the array's C-order bytes)."""
    header = _expected_header(dtype, shape)
    if header is None or data != header + raw:
        return
    with _lock:
        if len(_headers) < _MAX_HEADERS:
            _headers[(dtype, shape)] = header


def _plain(dtype: np.dtype) -> bool:
    return dtype.kind in _KINDS and dtype.fields is None and not dtype.hasobject


def to_array(ndarray: np.ndarray) -> Array:
    """``Array(ndarray)``: the same dtype, shape, stype and bytes."""
    array = np.asarray(ndarray)
    if type(array) is not np.ndarray or not array.flags.c_contiguous or not _plain(array.dtype):
        return Array(array)
    shape = tuple(array.shape)
    header = _headers.get((array.dtype, shape))
    if header is None:
        encoded = Array(array)
        _learn(array.dtype, shape, encoded.data, array.tobytes())
        return encoded
    data = header + array.tobytes()
    return Array(dtype=str(array.dtype), shape=shape, stype=SType.NUMPY, data=data)


def from_array(array: Array) -> np.ndarray:
    """``array.numpy()``: a fresh, writable array of the same dtype, shape and values.

    Raises:
        TypeError, ValueError: as ``Array.numpy()`` does (it is what runs on anything
            but an Array laid out exactly as ``np.save`` writes it).
    """
    if array.stype != SType.NUMPY:
        return array.numpy()
    try:
        dtype = np.dtype(array.dtype)
        shape = tuple(int(n) for n in array.shape)
    except (TypeError, ValueError):
        return array.numpy()
    header = _headers.get((dtype, shape))
    data = array.data
    if header is None or not _plain(dtype):
        decoded = array.numpy()
        if _plain(dtype) and decoded.dtype == dtype and decoded.shape == shape:
            _learn(dtype, shape, data, decoded.tobytes())
        return decoded
    count = math.prod(shape)
    if len(data) != len(header) + count * dtype.itemsize or not data.startswith(header):
        return array.numpy()
    return np.frombuffer(data, dtype=dtype, count=count, offset=len(header)).reshape(shape).copy()
