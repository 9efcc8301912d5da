"""Alignment as the first release stage, and the coordinator's plaintext harness.

:func:`align` is a :class:`~lensemble_flwr.release.pipeline.ReleaseTransform` at
``Stage.ALIGN``: it runs on the participant's trained shared weights before anything else
touches them. It embeds the pinned probe with the local and the global weights, sketches
both with the round's A, solves Procrustes, and replaces the local weights by the same
network expressed in the global frame. The difference stage after it re-differences those
against the global weights, and clipping, noise, quantization and masking then act on a
delta in the shared frame. :func:`chain` refuses any order that puts alignment later.

:func:`coordinator_harness` does the same to one plaintext delta at the coordinator. It
exists for research runs without privacy stages only (the config refuses it otherwise).
A coordinator aligning many updates of one round computes what the round fixes (the sketch
A and the sketched global embeddings A·Z_global, :func:`alignment_target`) once, and runs
only the per-update part (:func:`harness_delta`) on each update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from lensemble_flwr.config import GaugeConfig
from lensemble_flwr.errors import ParameterMismatch, RoundError
from lensemble_flwr.gauge.adapter import GaugeAdapter
from lensemble_flwr.gauge.probe import Probe, check_pinned
from lensemble_flwr.gauge.procrustes import Alignment, procrustes_align
from lensemble_flwr.gauge.sketch import sketch_fingerprint, sketch_matrix
from lensemble_flwr.params import NamedArrays, check_same_layout, subtract
from lensemble_flwr.release.pipeline import (
    Release,
    ReleaseContext,
    ReleaseTransform,
    Stage,
    no_state,
)


@dataclasses.dataclass(frozen=True, eq=False)
class AlignmentTarget:
    """What every alignment of one round aligns onto, computed once per round.

    Attributes:
        global_params: the round's global shared weights (the layout every local must have).
        sketch: the round's sketch A (m × n).
        sketched_global: ``A @ Z_global``, the sketched probe embeddings of the global
            weights (m × d): the Procrustes target.
        fingerprint: ``sketch_fingerprint(A)``.
    """

    global_params: Mapping[str, np.ndarray]
    sketch: np.ndarray
    sketched_global: np.ndarray
    fingerprint: str


def alignment_target(
    adapter: GaugeAdapter,
    probe: Probe,
    gauge: GaugeConfig,
    global_params: Mapping[str, np.ndarray],
    round_seed: int,
) -> AlignmentTarget:
    """The round's sketch and sketched global embeddings (they depend on the round only).

    Raises:
        ConfigError: a negative ``round_seed`` or fewer than one sketch row.
        ParameterMismatch: ``global_params`` lack the encoder's tensors.
    """
    a = sketch_matrix(round_seed, gauge.sketch_rows, probe.size)  # (m, n)
    z_global = adapter.embed(global_params, probe.inputs)  # (n, d)
    return AlignmentTarget(global_params, a, a @ z_global, sketch_fingerprint(a))


def align_to_target(
    adapter: GaugeAdapter,
    probe: Probe,
    gauge: GaugeConfig,
    target: AlignmentTarget,
    local: Mapping[str, np.ndarray],
) -> tuple[NamedArrays, Alignment]:
    """``local`` expressed in the frame of ``target.global_params``, with the alignment.

    Raises:
        DegenerateProcrustes: the sketched probe embeddings do not determine a frame.
        ParameterMismatch: ``local`` and the global weights differ in names or shapes, or
            the adapter's rotation changed the layout.
    """
    check_same_layout(target.global_params, local, "align")
    z_local = adapter.embed(local, probe.inputs)  # (n, d)
    alignment = procrustes_align(
        target.sketch @ z_local,
        target.sketched_global,
        max_condition=gauge.max_condition,
        conditioning=gauge.conditioning,
        ridge=gauge.ridge,
    )
    rotated = adapter.rotate(local, alignment.q)
    check_same_layout(local, rotated, "rotate")
    return rotated, alignment


def align_to_global(
    adapter: GaugeAdapter,
    probe: Probe,
    gauge: GaugeConfig,
    *,
    local: Mapping[str, np.ndarray],
    global_params: Mapping[str, np.ndarray],
    round_seed: int,
) -> tuple[NamedArrays, Alignment, str]:
    """``local`` expressed in the frame of ``global_params``, with the alignment and the
    fingerprint of the sketch it used (:func:`alignment_target` then
    :func:`align_to_target`, for a single alignment).

    Raises:
        DegenerateProcrustes: the sketched probe embeddings do not determine a frame.
        ParameterMismatch: ``local`` and ``global_params`` differ in names or shapes.
    """
    check_same_layout(global_params, local, "align")
    target = alignment_target(adapter, probe, gauge, global_params, round_seed)
    rotated, alignment = align_to_target(adapter, probe, gauge, target, local)
    return rotated, alignment, target.fingerprint


def alignment_metadata(alignment: Alignment, fingerprint: str) -> dict[str, Any]:
    """What an aligned release reports (JSON-able)."""
    return {
        "sketch_fingerprint": fingerprint,
        "procrustes_condition": float(alignment.condition),
        "procrustes_residual_before": float(alignment.residual_before),
        "procrustes_residual_after": float(alignment.residual_after),
        "procrustes_conditioned": bool(alignment.conditioned),
    }


def align(adapter: GaugeAdapter, probe: Probe, gauge: GaugeConfig) -> ReleaseTransform:
    """The participant's alignment stage (``Stage.ALIGN``).

    Its update checks that the round announces the pinned probe, aligns ``release.local``
    to ``ctx.global_state.params`` on the round's sketch and records
    :func:`alignment_metadata` in ``release.metadata``.

    Raises (from the update):
        ProbeError: the round's probe is not ``probe``.
        DegenerateProcrustes: the alignment is ill-conditioned beyond the configured rule;
            the participant releases nothing.
        RoundError: there are no local weights (alignment must come before difference).
    """

    def update(release: Release, state: Any, ctx: ReleaseContext) -> tuple[Release, Any]:
        if release.local is None:
            raise RoundError("align: no local weights to align (align runs before difference)")
        check_pinned(probe, ctx.global_state.probe_hash, ctx.global_state.landmark_hashes)
        rotated, alignment, fingerprint = align_to_global(
            adapter,
            probe,
            gauge,
            local=release.local,
            global_params=ctx.global_state.params,
            round_seed=ctx.round_seed,
        )
        metadata = {**release.metadata, **alignment_metadata(alignment, fingerprint)}
        return release.replace(local=rotated, metadata=metadata), state

    return ReleaseTransform("align", Stage.ALIGN, no_state, update)


def _harness_local(
    global_params: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray]
) -> NamedArrays:
    """global + delta (float32), refusing a delta of another layout or a non-finite sum."""
    check_same_layout(global_params, delta, "coordinator harness")
    local = {
        name: np.asarray(global_params[name], dtype=np.float32)
        + np.asarray(delta[name], dtype=np.float32)
        for name in sorted(global_params)
    }
    if not all(np.all(np.isfinite(v)) for v in local.values()):
        raise ParameterMismatch("coordinator harness: non-finite delta")
    return local


def harness_delta(
    adapter: GaugeAdapter,
    probe: Probe,
    gauge: GaugeConfig,
    target: AlignmentTarget,
    delta: Mapping[str, np.ndarray],
) -> NamedArrays:
    """:func:`coordinator_harness` against a round's precomputed ``target``: the per-update
    part, for a coordinator that aligns many updates of one round.

    Raises:
        DegenerateProcrustes: as :func:`align`.
        ParameterMismatch: ``delta`` does not have the layout of the global weights, or
            global + delta is not finite.
    """
    local = _harness_local(target.global_params, delta)
    rotated, _ = align_to_target(adapter, probe, gauge, target, local)
    return subtract(rotated, target.global_params)


def coordinator_harness(
    adapter: GaugeAdapter,
    probe: Probe,
    gauge: GaugeConfig,
    global_params: Mapping[str, np.ndarray],
    delta: Mapping[str, np.ndarray],
    round_seed: int,
) -> NamedArrays:
    """The aligned version of one plaintext ``delta``: align global + delta to the global
    frame on the round's sketch and re-difference.

    Plaintext research harness only: it needs an individual, unclipped, unnoised delta.

    Raises:
        DegenerateProcrustes: as :func:`align`.
        ParameterMismatch: ``delta`` does not have the layout of ``global_params``, or
            global + delta is not finite.
    """
    local = _harness_local(global_params, delta)
    target = alignment_target(adapter, probe, gauge, global_params, round_seed)
    rotated, _ = align_to_target(adapter, probe, gauge, target, local)
    return subtract(rotated, global_params)
