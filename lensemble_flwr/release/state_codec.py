"""A release pipeline's state as named arrays plus JSON: exported with the participant.

A participant on Flower is rebuilt for every message, so the state of its release stages
(the noise stage's privacy charge, a custom stage's error-feedback residual or round
counter, ...) must travel with the rest of its state or it silently restarts every
round. :func:`export_release_state` turns a pipeline's state into ``(arrays, meta)`` —
numpy arrays by key and a JSON-able description — and :func:`import_release_state`
rebuilds exactly the same value from them.

What a stage's state may hold (anything else is refused at export, with a
:class:`~lensemble_flwr.errors.ConfigError` naming the stage; nothing is dropped):

* ``None``, ``bool``, ``int``, ``float`` (bit-exact, including NaN and infinities), ``str``;
* numpy arrays and numpy scalars of a boolean, integer or floating dtype (up to 64 bits,
  native byte order; any shape, including 0-d and empty), restored with the same dtype,
  shape and values;
* ``tuple``, ``list`` and ``dict`` of those (dict keys: hashable values of the same
  kinds, no arrays), and NamedTuples defined at module level.

Exact types only: a subclass (an ``OrderedDict``, an ``IntEnum``) is refused rather than
restored as something else.

NamedTuples are restored as their own class, found again by module and qualified name in
a module that is already imported (the codec never imports anything: the module that
defines a stage is imported by whoever built the pipeline), and checked against the field
names recorded at export. A class that cannot be found by name (one defined inside a
function) is refused at export. The alternative — rebuilding each state from the stage's
``init`` and filling in values by structure — was rejected: ``init`` needs the round's
global params, which a participant restored between messages does not have, so a bad
state would surface only mid-round; and a state whose structure changes after ``init``
(``None`` until the first round, then an array) would not fit its own template.

The state must fit the pipeline it is restored into. The description names the stage of
every entry of a :class:`~lensemble_flwr.release.pipeline.ChainState` (from the chain's
``parts``); a state of another pipeline (other stages, another order), a description that
is malformed, or arrays that are missing, extra or of another dtype or shape are refused
with :class:`~lensemble_flwr.errors.RoundError`, before anything is rebuilt. ``None`` (a
pipeline whose state was never initialised) fits every pipeline, and so does the state
of a chain of stateless stages (it restores as None: e.g. a state saved before the mask
stage joined a masked federation's chain). A stage with a
``load_state`` check (the noise stage's :class:`~lensemble_flwr.release.accounting.PrivacyState`)
gets its rebuilt state checked by it before anything is returned.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from lensemble_flwr.errors import ConfigError, RoundError
from lensemble_flwr.release.pipeline import ChainState, ReleaseTransform

FORMAT = 1
"""Version of the description :func:`export_release_state` writes."""

_INT = re.compile(r"-?[0-9]+")
_DTYPE_KINDS = frozenset("biuf")


def export_release_state(
    pipeline: ReleaseTransform, state: Any
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``(arrays, meta)`` describing ``state``, the state of ``pipeline``.

    ``meta`` is JSON-able; ``arrays`` maps keys that ``meta`` refers to to C-contiguous
    copies of the state's arrays.

    Raises:
        ConfigError: some stage's state holds a value the module docstring does not
            allow (an unknown type, an object array, a NamedTuple defined in a function,
            a cycle); the field is ``release stage '<name>'`` and the reason says where
            in the state.
    """
    encoder = _Encoder()
    return encoder.arrays, {
        "format": FORMAT,
        "stage": pipeline.name,
        "state": encoder.stage(pipeline, state),
    }


def import_release_state(
    pipeline: ReleaseTransform, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]
) -> Any:
    """The state that :func:`export_release_state` described, for ``pipeline``.

    Raises:
        RoundError: ``meta`` is malformed, or describes the state of another pipeline, or
            ``arrays`` are not the arrays it refers to (missing, extra, another dtype or
            shape). Nothing is returned, so the caller's state stays as it was.
    """
    if not isinstance(meta, Mapping) or meta.get("format") != FORMAT:
        raise RoundError(f"release state: not a format-{FORMAT} description")
    node = meta.get("state")
    if meta.get("stage") != pipeline.name and _holds_nothing(node) and not arrays:
        return None  # stateless stages of another chain: nothing to restore, nothing lost
    if meta.get("stage") != pipeline.name:
        raise RoundError(
            f"release state: saved by pipeline {meta.get('stage')!r}, "
            f"which is not this participant's {pipeline.name!r}"
        )
    decoder = _Decoder(arrays)
    state = decoder.stage(pipeline, node, "state")
    unused = sorted(set(arrays) - decoder.used)
    if unused:
        raise RoundError(f"release state: arrays {unused[:5]} are not part of the state")
    return state


def _holds_nothing(node: Any) -> bool:
    """Whether ``node`` describes a state with nothing in it: None, or a chain of those
    (what a chain of stateless stages exports)."""
    if node == {"t": "none"}:
        return True
    parts = node.get("parts") if isinstance(node, Mapping) else None
    if node is None or not isinstance(parts, list) or node.get("t") != "chain":
        return False
    return all(isinstance(p, Mapping) and _holds_nothing(p.get("state")) for p in parts)


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _find_class(path: str) -> Any:
    """The object at ``module:qualname`` in an already imported module, or None."""
    module, _, qualname = path.partition(":")
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        if found is None or not part.isidentifier():
            return None
        found = getattr(found, part, None)
    return found


def _is_namedtuple(value: Any) -> bool:
    fields = getattr(type(value), "_fields", None)
    return isinstance(value, tuple) and isinstance(fields, tuple)


class _Encoder:
    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}
        self._open: set[int] = set()  # containers on the current path (cycle check)
        self._stage = ""

    def stage(self, transform: ReleaseTransform, state: Any) -> dict[str, Any]:
        if transform.parts and state is not None:
            if type(state) is not ChainState or len(state.states) != len(transform.parts):
                raise ConfigError(
                    f"release stage {transform.name!r}",
                    f"its state is not a ChainState of {len(transform.parts)} entries",
                )
            return {
                "t": "chain",
                "parts": [
                    {"stage": part.name, "state": self.stage(part, sub)}
                    for part, sub in zip(transform.parts, state.states, strict=True)
                ],
            }
        self._stage = transform.name
        return self.value(state, "state", key=False)

    def _refuse(self, where: str, reason: str) -> ConfigError:
        return ConfigError(f"release stage {self._stage!r}", f"{where}: {reason}")

    def value(self, value: Any, where: str, *, key: bool) -> dict[str, Any]:
        kind = type(value)
        if value is None:
            return {"t": "none"}
        if kind is bool:
            return {"t": "bool", "v": value}
        if kind is int:
            try:
                return {"t": "int", "v": str(value)}
            except ValueError as exc:  # more digits than Python converts to a string
                raise self._refuse(where, str(exc)) from None
        if kind is float:
            return {"t": "float", "v": value.hex()}
        if kind is str:
            return {"t": "str", "v": value}
        if kind is np.ndarray or isinstance(value, np.generic):
            if key:
                raise self._refuse(where, "an array cannot be a dict key")
            return self._array(value, where)
        if kind in (tuple, list, dict) or _is_namedtuple(value):
            if id(value) in self._open:
                raise self._refuse(where, "the state refers to itself (a cycle)")
            self._open.add(id(value))
            try:
                return self._container(value, where, key=key)
            finally:
                self._open.discard(id(value))
        raise self._refuse(
            where, f"cannot export a value of type {kind.__module__}.{kind.__qualname__}"
        )

    def _array(self, value: np.ndarray | np.generic, where: str) -> dict[str, Any]:
        array = np.asarray(value)
        dtype = array.dtype
        if dtype.kind not in _DTYPE_KINDS or dtype.itemsize > 8:
            raise self._refuse(where, f"cannot export an array of dtype {dtype}")
        if dtype.byteorder not in ("=", "|"):
            raise self._refuse(where, f"cannot export an array of byte order {dtype.str!r}")
        name = str(len(self.arrays))
        self.arrays[name] = np.array(array, copy=True, order="C")
        return {
            "t": "array",
            "key": name,
            "dtype": dtype.str,
            "shape": list(array.shape),
            "scalar": isinstance(value, np.generic),
        }

    def _container(self, value: Any, where: str, *, key: bool) -> dict[str, Any]:
        if isinstance(value, dict):
            if key:
                raise self._refuse(where, "a dict cannot be a dict key")
            return {
                "t": "dict",
                "items": [
                    [
                        self.value(k, f"{where} key {k!r}", key=True),
                        self.value(v, f"{where}[{k!r}]", key=False),
                    ]
                    for k, v in value.items()
                ],
            }
        if isinstance(value, list):
            if key:
                raise self._refuse(where, "a list cannot be a dict key")
            items = [self.value(v, f"{where}[{i}]", key=False) for i, v in enumerate(value)]
            return {"t": "list", "items": items}
        if type(value) is tuple:
            items = [self.value(v, f"{where}[{i}]", key=key) for i, v in enumerate(value)]
            return {"t": "tuple", "items": items}
        cls = type(value)
        path = _class_path(cls)
        if _find_class(path) is not cls:
            raise self._refuse(
                where,
                f"NamedTuple {path} cannot be found again by its name; define it at the "
                "top level of a module",
            )
        return {
            "t": "namedtuple",
            "class": path,
            "fields": list(cls._fields),
            "items": [
                self.value(v, f"{where}.{f}", key=key)
                for f, v in zip(cls._fields, value, strict=True)
            ],
        }


class _Decoder:
    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.arrays = arrays
        self.used: set[str] = set()

    @staticmethod
    def _malformed(where: str, reason: str) -> RoundError:
        return RoundError(f"release state: {where}: {reason}")

    def stage(self, transform: ReleaseTransform, node: Any, where: str) -> Any:
        if not isinstance(node, Mapping):
            raise self._malformed(where, "not a description")
        if not transform.parts or node.get("t") == "none":
            value = self.value(node, where)
            if value is not None and transform.load_state is not None:
                value = transform.load_state(value)  # the stage's own check (RoundError)
            return value
        parts = node.get("parts")
        if node.get("t") != "chain" or not isinstance(parts, list):
            raise self._malformed(where, f"{transform.name!r} keeps a ChainState")
        if len(parts) != len(transform.parts):
            raise self._malformed(
                where,
                f"{len(parts)} stage states for the {len(transform.parts)} stages of "
                f"{transform.name!r}",
            )
        states = []
        for i, (part, entry) in enumerate(zip(transform.parts, parts, strict=True)):
            here = f"{where}[{i}]"
            if not isinstance(entry, Mapping) or entry.get("stage") != part.name:
                saved = entry.get("stage") if isinstance(entry, Mapping) else None
                raise self._malformed(
                    here, f"saved by stage {saved!r}, but the stage here is {part.name!r}"
                )
            states.append(self.stage(part, entry.get("state"), here))
        return ChainState(tuple(states))

    def value(self, node: Any, where: str) -> Any:
        if not isinstance(node, Mapping):
            raise self._malformed(where, "not a description")
        kind = node.get("t")
        v = node.get("v")
        if kind == "none":
            return None
        if kind == "bool" and type(v) is bool:
            return v
        if kind == "int" and isinstance(v, str) and _INT.fullmatch(v):
            return int(v)
        if kind == "float" and isinstance(v, str):
            try:
                return float.fromhex(v)
            except (ValueError, OverflowError):
                raise self._malformed(where, f"{v!r} is not a float") from None
        if kind == "str" and isinstance(v, str):
            return v
        if kind == "array":
            return self._array(node, where)
        items = node.get("items")
        if kind in ("tuple", "list", "namedtuple", "dict") and isinstance(items, list):
            return self._container(kind, node, items, where)
        raise self._malformed(where, f"unknown or malformed value {str(dict(node))[:120]}")

    def _array(self, node: Mapping[str, Any], where: str) -> Any:
        key, dtype, shape = node.get("key"), node.get("dtype"), node.get("shape")
        if not isinstance(key, str) or key not in self.arrays:
            raise self._malformed(where, f"array {key!r} is missing")
        if key in self.used:
            raise self._malformed(where, f"array {key!r} is referred to twice")
        self.used.add(key)
        array = np.asarray(self.arrays[key])
        if array.dtype.str != dtype or not isinstance(shape, list) or list(array.shape) != shape:
            raise self._malformed(
                where,
                f"array {key!r} is {array.dtype.str} {list(array.shape)}, "
                f"the state says {dtype} {shape}",
            )
        restored = np.array(array, copy=True)
        if node.get("scalar") is True:
            if restored.ndim:
                raise self._malformed(where, f"array {key!r} is not a scalar")
            return restored[()]
        return restored

    def _container(self, kind: str, node: Mapping[str, Any], items: list, where: str) -> Any:
        if kind == "dict":
            out: dict[Any, Any] = {}
            for i, pair in enumerate(items):
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise self._malformed(f"{where} item {i}", "not a key and a value")
                k = self.value(pair[0], f"{where} key {i}")
                try:
                    hash(k)
                except TypeError:
                    raise self._malformed(f"{where} key {i}", "not hashable") from None
                out[k] = self.value(pair[1], f"{where}[{k!r}]")
            return out
        values = [self.value(item, f"{where}[{i}]") for i, item in enumerate(items)]
        if kind == "list":
            return values
        if kind == "tuple":
            return tuple(values)
        path, fields = node.get("class"), node.get("fields")
        cls = _find_class(path) if isinstance(path, str) else None
        if not (
            isinstance(cls, type)
            and issubclass(cls, tuple)
            and isinstance(fields, list)
            and getattr(cls, "_fields", None) == tuple(fields)
            and len(values) == len(fields)
        ):
            raise self._malformed(
                where, f"no NamedTuple {path!r} with fields {fields!r} is imported here"
            )
        return cls._make(values)
