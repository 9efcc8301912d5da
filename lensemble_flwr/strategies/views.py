"""Read-only views of a strategy's private settings, and FedAvg's attribute names as such.

A view has no setter: a subclass that assigns an attribute of the same name stores its
own value, which lensemble never reads (Flower's advanced-pytorch example sets
``self.run_dir`` to its W&B run name), and reading the name where nothing shadows it gives
lensemble's value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ReadOnly:
    """A read-only view of the strategy's private state, which a subclass may shadow with
    an attribute of its own of the same name (the view has no setter, so assigning one
    stores the subclass's value, which lensemble never reads)."""

    def __init__(self, read: Callable[[Any], Any], doc: str) -> None:
        self._read = read
        self.__doc__ = doc

    def __get__(self, strategy: Any, owner: type | None = None) -> Any:
        return self if strategy is None else self._read(strategy)


class FedAvgAttributes:
    """FedAvg's attributes, read as an override copied from a FedAvg subclass reads them;
    they say what the constructor was given (set them through it)."""

    fraction_train = ReadOnly(
        lambda s: s._config.federation.sample_fraction, "FedAvg's fraction_train."
    )
    min_train_nodes = ReadOnly(lambda s: s._config.federation.sample_min, "FedAvg's.")
    min_available_nodes = ReadOnly(lambda s: s._config.federation.min_available, "FedAvg's.")
    fraction_evaluate = ReadOnly(lambda s: s._fraction_evaluate, "FedAvg's fraction_evaluate.")
    min_evaluate_nodes = ReadOnly(lambda s: s._min_evaluate_nodes, "FedAvg's.")
    weighted_by_key = ReadOnly(lambda s: s._weighted_by_key, "FedAvg's weighted_by_key.")
    arrayrecord_key = ReadOnly(lambda s: s._arrayrecord_key, "FedAvg's arrayrecord_key.")
    configrecord_key = ReadOnly(lambda s: s._configrecord_key, "FedAvg's configrecord_key.")
    train_metrics_aggr_fn = ReadOnly(lambda s: s._train_metrics_aggr_fn, "FedAvg's.")
    evaluate_metrics_aggr_fn = ReadOnly(lambda s: s._evaluate_metrics_aggr_fn, "FedAvg's.")
    on_round = ReadOnly(lambda s: s._on_round, "The callback each round's line goes to.")
