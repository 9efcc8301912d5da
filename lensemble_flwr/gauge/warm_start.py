"""The warm start: every participant starts the first round from the same encoder.

Alignment maps a local frame onto the global one; it cannot create a shared frame from
nothing. In round 1 every participant therefore checks that the encoder of θ_0 it is given is
hash-identical to the published warm start (``gauge-warm-start-hash``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from lensemble_flwr.canonical import digest_arrays
from lensemble_flwr.errors import GaugeError
from lensemble_flwr.params import in_group


def encoder_hash(params: Mapping[str, np.ndarray], names: Iterable[str]) -> str:
    """Digest of the encoder's arrays in ``params``.

    Args:
        params: named arrays (e.g. a global state's shared params).
        names: the encoder's parameter groups, matched by
            :func:`~lensemble_flwr.params.in_group` (``("encoder",)`` for the world model).

    Raises:
        GaugeError: no array of ``params`` belongs to ``names``.
    """
    groups = tuple(names)
    selected = {n: np.asarray(a) for n, a in params.items() if any(in_group(n, g) for g in groups)}
    if not selected:
        raise GaugeError(f"no parameter belongs to the encoder groups {list(groups)}")
    return digest_arrays(selected, "gauge-warm-start")


def check_warm_start(
    params: Mapping[str, np.ndarray], names: Iterable[str], expected_hash: str
) -> None:
    """Refuse an initial (θ_0) encoder that is not the published warm start.

    An empty ``expected_hash`` means no warm start is published (the config's
    ``gauge-warm-start-hash = ""``) and nothing is checked.

    Raises:
        GaugeError: the encoder's hash differs from ``expected_hash``, or ``params`` has
            no encoder arrays.
    """
    if not expected_hash:
        return
    actual = encoder_hash(params, names)
    if actual != expected_hash:
        raise GaugeError(
            f"initial (θ_0) encoder {actual[:12]}... is not the warm start {expected_hash[:12]}..."
        )
