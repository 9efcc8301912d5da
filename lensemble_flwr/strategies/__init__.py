"""The coordinator as a Flower Strategy (Message API).

The names are resolved on first use: a ClientApp process imports
:mod:`lensemble_flwr.strategies.records` (the wire format both sides share) and must not
pay for importing the coordinator and Flower's SuperLink with it (a SuperNode may start a
process for every message).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "GridTransport": "lensemble_flwr.strategies.grid_transport",
    "LensembleResult": "lensemble_flwr.strategies.lensemble",
    "LensembleStrategy": "lensemble_flwr.strategies.lensemble",
}

__all__ = ["GridTransport", "LensembleResult", "LensembleStrategy"]

if TYPE_CHECKING:
    from lensemble_flwr.strategies.grid_transport import GridTransport
    from lensemble_flwr.strategies.lensemble import LensembleResult, LensembleStrategy


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lensemble_flwr.strategies' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
