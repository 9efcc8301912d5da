"""The user's arrays as the user gave them: names, order, and what is not federated.

Inside lensemble, named arrays are in canonical (sorted) order and every one of them is
floating-point: that is what is hashed, summed and stepped. A Flower user's
``ArrayRecord`` is neither: its names come in ``state_dict`` order, which code such as
``zip(model.state_dict().keys(), arrays)`` and Flower's own DP wrappers and mods rely
on, and a model with BatchNorm holds an integer ``num_batches_tracked``.

:class:`ArrayLayout` keeps both views apart. It remembers the initial record's names in
their order and the arrays that are *carried*: non-floating arrays, which travel with
the model to every node exactly as given and are never averaged or stepped (the mean of
two counts is not a count). Everything a user or a Flower component sees is rebuilt in
the initial order, carried arrays included; only the floating-point arrays reach the
coordinator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
from flwr.app import ArrayRecord

from lensemble_flwr.errors import ParameterMismatch
from lensemble_flwr.strategies.array_codec import from_array, to_array

NamedArrays = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class ArrayLayout:
    """The names of a model's ArrayRecord in order, and its carried (non-float) arrays."""

    order: tuple[str, ...]
    carried: Mapping[str, np.ndarray]

    @classmethod
    def split(cls, record: ArrayRecord) -> tuple[ArrayLayout, NamedArrays]:
        """The layout of ``record`` and its floating-point arrays (what is federated).

        Raises:
            ParameterMismatch: ``record`` holds no floating-point array (nothing to train).
        """
        carried: NamedArrays = {}
        federated: NamedArrays = {}
        for name in record:
            array = from_array(record[name])
            if np.issubdtype(array.dtype, np.floating):
                federated[name] = array
            else:
                frozen = np.array(array, copy=True)
                frozen.setflags(write=False)
                carried[name] = frozen
        if not federated:
            raise ParameterMismatch(
                f"the initial arrays hold no floating-point array to federate: {list(record)}"
            )
        return cls(order=tuple(record), carried=carried), federated

    @property
    def carried_names(self) -> list[str]:
        """The carried arrays' names, in the record's order."""
        return [name for name in self.order if name in self.carried]

    def to_record(self, federated: Mapping[str, np.ndarray]) -> ArrayRecord:
        """``federated`` plus the carried arrays, in the initial record's order.

        Raises:
            ParameterMismatch: ``federated`` does not hold exactly the federated names.
        """
        expected = set(self.order) - set(self.carried)
        if set(federated) != expected:
            missing = sorted(expected - set(federated))
            extra = sorted(set(federated) - expected)
            raise ParameterMismatch(f"arrays: missing {missing}, unexpected {extra}")
        return ArrayRecord(
            {
                name: to_array(self.carried[name] if name in self.carried else federated[name])
                for name in self.order
            }
        )
