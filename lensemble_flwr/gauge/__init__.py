"""Gauge alignment: participants rotate their latent frame onto the global one before release.

One idea per module: :mod:`.probe` (the pinned public probe), :mod:`.sketch` (the round's
probe sketch), :mod:`.procrustes` (the orthogonal alignment and its conditioning rule),
:mod:`.adapter` (where a model's latent frame lives), :mod:`.drift` (a public diagnostic of
how far the global frame moves), :mod:`.warm_start` (the θ_0 encoder pin) and
:mod:`.stage` (alignment as a release stage). See ``docs/gauge.md``.
"""

from lensemble_flwr.gauge.adapter import GaugeAdapter
from lensemble_flwr.gauge.drift import frame_drift
from lensemble_flwr.gauge.probe import Probe, check_pinned
from lensemble_flwr.gauge.procrustes import CONDITIONING_RULES, Alignment, procrustes_align
from lensemble_flwr.gauge.sketch import sketch_fingerprint, sketch_matrix
from lensemble_flwr.gauge.stage import (
    AlignmentTarget,
    align,
    align_to_global,
    align_to_target,
    alignment_metadata,
    alignment_target,
    coordinator_harness,
    harness_delta,
)
from lensemble_flwr.gauge.warm_start import check_warm_start, encoder_hash

__all__ = [
    "CONDITIONING_RULES",
    "Alignment",
    "AlignmentTarget",
    "GaugeAdapter",
    "Probe",
    "align",
    "align_to_global",
    "align_to_target",
    "alignment_metadata",
    "alignment_target",
    "check_pinned",
    "check_warm_start",
    "coordinator_harness",
    "encoder_hash",
    "frame_drift",
    "harness_delta",
    "procrustes_align",
    "sketch_fingerprint",
    "sketch_matrix",
]
