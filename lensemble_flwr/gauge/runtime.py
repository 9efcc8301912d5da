"""The runtime's side of gauge alignment: where the gauge checks sit in a round.

:mod:`lensemble_flwr.gauge` holds the mathematics (probe, sketch, Procrustes, drift,
warm start). This module wires it into the round, for both ends:

* the **participant** checks, on every RoundOpen, that the announced probe is the one it
  pinned (else ``ProbeError``: it rejects the round) and, in round 1, that the encoder is
  the agreed warm start (else ``GaugeError``); its release pipeline aligns before
  anything else touches the weights (``release_pipeline(..., gauge=...)``);
* the **coordinator** announces the probe, refuses an update aligned on another sketch
  than the round's (``SketchMismatch``: the contribution is rejected, the round goes on),
  and at ALIGNING computes ``frame_drift`` from the previous global model and the
  averaged one on the public probe only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping

import numpy as np

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import ConfigError, LensembleError, SketchMismatch

# from the submodules: the package also holds the align stage, which builds on the
# release pipeline, which builds on this package
from lensemble_flwr.gauge.adapter import GaugeAdapter
from lensemble_flwr.gauge.drift import frame_drift
from lensemble_flwr.gauge.probe import Probe, check_pinned
from lensemble_flwr.gauge.sketch import sketch_fingerprint, sketch_matrix
from lensemble_flwr.gauge.warm_start import check_warm_start
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.protocol.messages import Update

log = logging.getLogger(__name__)

ENCODER_GROUP = "encoder"
"""The parameter group whose θ_0 hash is the warm start, unless a GaugeSetup says
otherwise."""


@dataclasses.dataclass(frozen=True)
class GaugeSetup:
    """What a party needs to align latent frames: the model's gauge adapter and the
    pinned public probe. ``encoder_group`` names the parameter group whose θ_0
    hash is the warm start."""

    adapter: GaugeAdapter
    probe: Probe
    encoder_group: str = ENCODER_GROUP


def require_setup(config: LensembleConfig, gauge: GaugeSetup | None) -> None:
    """Refuse a configuration that asks for alignment without saying how to align.

    Raises:
        ConfigError: ``gauge-align`` or ``gauge-coordinator-harness`` is on and no
            :class:`GaugeSetup` was given.
    """
    for key, on in (
        ("gauge-align", config.gauge.align),
        ("gauge-coordinator-harness", config.gauge.coordinator_harness),
    ):
        if on and gauge is None:
            raise ConfigError(key, "needs a GaugeSetup (the model's gauge adapter and probe)")


def check_round_open(
    gauge: GaugeSetup | None,
    config: LensembleConfig,
    *,
    round: int,
    probe_hash: str,
    landmark_hashes: tuple[str, ...],
    params: Mapping[str, np.ndarray],
) -> None:
    """The participant's checks of a RoundOpen before it trains.

    Raises:
        ProbeError: the announced probe or landmarks are not the pinned ones.
        GaugeError: round 1's encoder (θ_0's) is not the agreed warm start.
    """
    if gauge is not None and config.gauge.align:
        check_pinned(gauge.probe, probe_hash, landmark_hashes)
    check_warm_start_at_t0(gauge, config, round=round, params=params)


def check_warm_start_at_t0(
    gauge: GaugeSetup | None,
    config: LensembleConfig,
    *,
    round: int,
    params: Mapping[str, np.ndarray],
) -> None:
    """INV-WARMSTART-T0 where a participant is about to train round ``round`` from
    ``params``: round 1 (Flower's numbering: the first round, which starts from θ_0)
    must start from the agreed warm-start encoder; a later round passes. The one check
    of every participant-side path: a RoundOpen, a direct ``local_round`` and a rejoin.

    Raises:
        GaugeError: round 1's encoder is not the warm start.
    """
    if round == 1:
        check_warm_start_of(gauge, config, params)


def check_warm_start_of(
    gauge: GaugeSetup | None, config: LensembleConfig, params: Mapping[str, np.ndarray]
) -> None:
    """θ_0's encoder must hash to ``gauge-warm-start-hash`` (when one is set).

    Raises:
        GaugeError: it does not.
    """
    expected = config.gauge.warm_start_hash
    if not expected:
        return
    group = gauge.encoder_group if gauge is not None else ENCODER_GROUP
    check_warm_start(params, (group,), expected)


def expected_fingerprint(gauge: GaugeSetup, config: LensembleConfig, round_seed: int) -> str:
    """The fingerprint of the sketch every participant must align on in this round."""
    a = sketch_matrix(round_seed, config.gauge.sketch_rows, len(gauge.probe.inputs))
    return sketch_fingerprint(a)


def check_sketch(update: Update, expected: str) -> None:
    """Raises SketchMismatch when ``update`` was aligned on another sketch."""
    if update.sketch_fingerprint != expected:
        got = update.sketch_fingerprint
        raise SketchMismatch(
            f"{update.participant_id}: aligned on sketch {str(got)[:12]}…, the round's is "
            f"{expected[:12]}…; contribution rejected"
        )


def drift_diagnostics(
    gauge: GaugeSetup,
    config: LensembleConfig,
    before: Mapping[str, np.ndarray],
    mean_delta: Mapping[str, np.ndarray],
    *,
    round: int,
) -> dict[str, float]:
    """``frame_drift`` between the global model and the averaged one (public probe only);
    ``frame_drift_exceeded`` is 1.0 when it crosses ``gauge-drift-threshold``; a drift
    that cannot be computed is reported as ``frame_drift_failed``, never raised."""
    averaged = {n: np.asarray(before[n]) + np.asarray(mean_delta[n]) for n in before}
    try:
        drift = float(frame_drift(gauge.adapter, gauge.probe, before, averaged))
    except LensembleError as exc:  # a diagnostic never stops a run
        log.warning("round %d: frame drift not computed: %s", round, exc)
        return {"frame_drift_failed": 1.0}
    out = {"frame_drift": drift}
    threshold = config.gauge.drift_threshold
    if threshold > 0 and drift > threshold:
        log.warning(
            "round %d: frame drift %.4f exceeds the threshold %.4f", round, drift, threshold
        )
        out["frame_drift_exceeded"] = 1.0
    return out


def harness_transform(
    gauge: GaugeSetup, config: LensembleConfig, params: NamedArrays, round_seed: int
) -> Callable[[Update], Update]:
    """The plaintext research harness: align each raw update on the coordinator.

    The round's target (its sketch and the sketched global embeddings) is computed once,
    at the first update, and reused for every other update of the round; computed there,
    a failure rejects that update as before instead of stopping the round from opening.
    """
    # see the imports above
    from lensemble_flwr.gauge.stage import AlignmentTarget, alignment_target, harness_delta

    round_target: list[AlignmentTarget] = []

    def transform(update: Update) -> Update:
        if not round_target:
            round_target.append(
                alignment_target(gauge.adapter, gauge.probe, config.gauge, params, round_seed)
            )
        delta = harness_delta(
            gauge.adapter, gauge.probe, config.gauge, round_target[0], update.delta
        )
        return update.model_copy(update={"delta": delta})

    return transform
