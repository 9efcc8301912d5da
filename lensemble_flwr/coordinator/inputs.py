"""What every round of a run starts from, derived from values only.

A :class:`RoundInputs` holds what a run fixes once (its config, id, gauge setup and any
research transform) and derives, for each round: the pinned global state θ_r with the
seed of the round that starts from it, the attempt's RoundOpen, the transform applied to
each plaintext update before it is summed, and the aggregate-level diagnostics of
ALIGNING. It reads no clock, no transport and no store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from lensemble_flwr.canonical import derive_seed
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.gauge.runtime import (
    GaugeSetup,
    drift_diagnostics,
    expected_fingerprint,
    harness_transform,
)
from lensemble_flwr.norms import l2_norm
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.protocol.messages import RoundOpen, Update
from lensemble_flwr.protocol.state import GlobalState
from lensemble_flwr.transports.base import COORDINATOR


@dataclasses.dataclass(frozen=True)
class RoundInputs:
    """The run's fixed inputs, and what each round derives from them (see the module).

    Attributes:
        config: the federation's config.
        run_id: names the run in every message.
        gauge: the model's gauge adapter and pinned probe, if any.
        update_transform: a coordinator-side transform of each plaintext update (a
            research harness), if any.
        noise_multiplier: the DP noise multiplier the config plans (0 without DP).
    """

    config: LensembleConfig
    run_id: str
    gauge: GaugeSetup | None = None
    update_transform: Callable[[Update], Update] | None = None
    noise_multiplier: float = 0.0

    def pin(
        self, round: int, params: Mapping[str, np.ndarray], *, copy: bool = True
    ) -> GlobalState:
        """θ_``round``, carrying the seed of the round that starts from it (round + 1)."""
        fed = self.config.federation
        pinned = self.gauge is not None and self.config.gauge.align
        probe = self.gauge.probe if pinned else None  # type: ignore[union-attr]
        return GlobalState.create(
            round,
            params,
            sketch_seed=derive_seed(fed.root_seed, "round", round + 1),
            h_steps=self.config.inner.steps,
            probe_hash=probe.probe_hash if probe is not None else "",
            landmark_hashes=probe.landmark_hashes if probe is not None else (),
            copy=copy,
        )

    def round_open(self, state: GlobalState, attempt: int) -> RoundOpen:
        """The RoundOpen of attempt ``attempt`` of the round that starts from ``state``."""
        return RoundOpen(
            run_id=self.run_id,
            round=state.next_round,
            sender=COORDINATOR,
            attempt=attempt,
            global_hash=state.params_hash,
            params=state.params,
            sketch_seed=state.sketch_seed,
            h_steps=state.h_steps,
            probe_hash=state.probe_hash,
            landmark_hashes=state.landmark_hashes,
        )

    def fingerprint(self, state: GlobalState) -> str | None:
        """The sketch fingerprint every update of the round must carry (gauge alignment),
        or None when the round is not aligned."""
        if self.gauge is None or not self.config.gauge.align:
            return None
        return expected_fingerprint(self.gauge, self.config, state.sketch_seed)

    def transform(self, state: GlobalState) -> Callable[[Update], Update] | None:
        """What transforms each plaintext update before it is summed (research only)."""
        if self.config.gauge.coordinator_harness:
            assert self.gauge is not None  # require_setup
            return harness_transform(self.gauge, self.config, state.params, state.sketch_seed)
        return self.update_transform

    def diagnose(self, state: GlobalState, mean: NamedArrays) -> dict[str, float]:
        """ALIGNING: diagnostics of the averaged model only (public probe, no individual
        update: a masked round has none to look at)."""
        diagnostics = {"mean_delta_l2": l2_norm(mean)}
        if self.gauge is not None:
            diagnostics |= drift_diagnostics(
                self.gauge, self.config, state.params, mean, round=state.next_round
            )
        return diagnostics
