"""The strategy's arguments, checked when it is made (not once the run started).

:func:`check_arguments` refuses, naming the argument, what would only fail later;
:func:`with_sampling` folds FedAvg's sampling arguments into the federation config.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

from lensemble_flwr.config import FederationConfig, LensembleConfig
from lensemble_flwr.errors import ConfigError, ForgedMessage
from lensemble_flwr.identity.signing import parse_public_key


def with_sampling(config: LensembleConfig, **given: float | int | None) -> LensembleConfig:
    """``config`` with the sampling fields given (not None) replaced, validated.

    Raises:
        ConfigError: a value out of range, named by the strategy argument that gave it
            (``fraction_train``, ``min_train_nodes``, ``min_available_nodes``).
    """
    updates = {field: value for field, value in given.items() if value is not None}
    if not updates:
        return config
    try:
        federation = FederationConfig(**{**config.federation.model_dump(), **updates})
    except ConfigError as exc:  # said in the strategy's terms: the argument, as given
        for field, argument in _SAMPLING_ARGUMENTS.items():
            if exc.field.endswith(f".{field}") and field in updates:
                raise ConfigError(argument, exc.reason) from None
        raise
    return config.model_copy(update={"federation": federation})


_SAMPLING_ARGUMENTS = {
    "sample_fraction": "fraction_train",
    "sample_min": "min_train_nodes",
    "min_available": "min_available_nodes",
}
"""The federation config's sampling fields, by the strategy argument that sets them."""


def check_arguments(
    config: object,
    identities: Mapping[str, str] | None,
    *,
    seconds: Mapping[str, object],
    keys: Mapping[str, object],
    callbacks: Mapping[str, object],
    evaluation: tuple[float, int] = (1.0, 0),
) -> None:
    """Refuse, naming the argument, what would only fail once the run started (an
    untyped ``AttributeError``, a key library's error, ``time.sleep``'s ValueError, or a
    SuperLink pulled in a tight loop).

    Raises:
        ConfigError: ``config`` is not a LensembleConfig (FedAvg's first positional
            argument is ``fraction_train``), ``poll_interval`` is not a finite number
            > 0 or ``warmup_timeout`` not one >= 0, an ``identities`` value is not an
            OpenSSH ECDSA public key, a record key or ``weighted_by_key`` is not a
            non-empty string, a callback is not callable, or ``evaluation``
            (``fraction_evaluate``, ``min_evaluate_nodes``) is not in [0, 1] and >= 0.
    """
    if config is not None and not isinstance(config, LensembleConfig):
        raise ConfigError(
            "config",
            f"must be a LensembleConfig (or None), got {config!r}: FedAvg's arguments "
            "(fraction_train=..., min_train_nodes=...) are given by name",
        )
    for name, value in seconds.items():
        floor = "> 0" if name == "poll_interval" else ">= 0"
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ConfigError(name, f"must be a number of seconds, got {value!r}")
        if not math.isfinite(value) or (value <= 0 if floor == "> 0" else value < 0):
            raise ConfigError(name, f"must be a finite number of seconds {floor}, got {value!r}")
    for pid, key in (identities or {}).items():
        try:
            parse_public_key(key if isinstance(key, str) else repr(key))
        except ForgedMessage as exc:
            raise ConfigError(f"identities[{pid!r}]", str(exc)) from None
    for name, value in keys.items():
        if not isinstance(value, str) or not value:
            raise ConfigError(name, f"must be a non-empty string, got {value!r}")
    for name, callback in callbacks.items():
        if callback is not None and not callable(callback):
            raise ConfigError(name, f"must be callable (or None), got {callback!r}")
    fraction, fewest = evaluation
    if not 0 <= fraction <= 1 or fewest < 0:
        raise ConfigError(
            "fraction_evaluate",
            f"must be in [0, 1] with min_evaluate_nodes >= 0, got {fraction} and {fewest}",
        )
