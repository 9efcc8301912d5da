"""A global model changed after lensemble committed it, adopted as the next round's start.

Flower's central-DP wrappers add their noise to the aggregate after ``aggregate_train``
returned it, and an ``aggregate_train`` override may step it; the next round's
``configure_train`` is then handed the changed model. :class:`ModelChanges` has the
coordinator adopt it as the round's external step, recorded in its manifest entries and
ledger record (see :mod:`lensemble_flwr.coordinator.external_step`). Carried (integer)
arrays are not federated: a change to them is logged and left out.
"""

from __future__ import annotations

import logging
from logging import INFO

import numpy as np
from flwr.app import ArrayRecord
from flwr.common import log as say

from lensemble_flwr.config import OuterOptimizerConfig
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.coordinator.outer_optimizer import influence_scale
from lensemble_flwr.errors import ParameterMismatch
from lensemble_flwr.strategies.layout import ArrayLayout

log = logging.getLogger(__name__)


class ModelChanges:
    """Adopts changed models for one strategy (see the module)."""

    def __init__(self) -> None:
        self._said_influence = False

    def adopt(
        self,
        coordinator: Coordinator,
        layout: ArrayLayout,
        returned: ArrayRecord,
        arrays: ArrayRecord,
        server_round: int,
    ) -> bool:
        """Have ``coordinator`` train round ``server_round`` from ``arrays``, where
        ``aggregate_train`` returned ``returned``. Whether a change was adopted.

        Raises:
            ParameterMismatch: ``arrays`` does not fit the global model (names, shapes,
                dtypes, non-finite values); nothing changes.
            IllegalTransition: the round already trained from another model.
        """
        if list(arrays) != list(returned):
            raise ParameterMismatch(
                f"round {server_round}: configure_train got arrays {list(arrays)[:5]}…, "
                f"not the global model's {list(returned)[:5]}…"
            )
        changed_carried = [
            name
            for name in layout.carried_names
            if not np.array_equal(arrays[name].numpy(), returned[name].numpy())
        ]
        if changed_carried:
            log.warning(
                "round %d: %s changed after aggregation; non-floating arrays are carried "
                "as given, so the change is not used",
                server_round,
                changed_carried,
            )
        federated = {n: arrays[n].numpy() for n in arrays if n not in layout.carried}
        step = coordinator.adopt(federated)
        if step is None:
            return False
        say(
            INFO,
            "\t├── the global model was changed after lensemble committed it (a wrapping "
            "strategy's step such as Flower's central DP noise, or an aggregate_train "
            "override; change norm %.4g): "
            "round %d trains from the changed model, and its ledger record says so",
            step.change_norm,
            server_round,
        )
        self._say_influence_once(coordinator.config.outer)
        return True

    def _say_influence_once(self, outer: OuterOptimizerConfig) -> None:
        """Warn, once, that the outer step scales a DP wrapper's calibrated noise."""
        scale = influence_scale(outer)
        if self._said_influence or abs(scale - 1.0) <= 1e-9:
            return
        self._said_influence = True
        log.warning(
            "if that change is a DP wrapper's noise: the outer step (lr %.3g, momentum "
            "%.3g) scales each round's mean update by %.3g before it is added, so "
            "noise calibrated for FedAvg's step then has %.3g times its noise "
            "multiplier. For the wrapper's stated "
            "guarantee use FedAvg's step: lensemble.outer-lr = 1, "
            "lensemble.outer-momentum = 0",
            outer.lr,
            outer.momentum,
            scale,
            1.0 / scale,
        )
