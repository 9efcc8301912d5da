"""The release stages this package supplies: difference and bind.

``difference`` turns trained local weights into Δ = local − global over the shared
groups. ``bind`` attaches the participant's dataset Merkle root; the coordinator refuses
an update whose root differs from its sender's commitment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import ConfigError, RoundError
from lensemble_flwr.params import subtract
from lensemble_flwr.privacy.budget import PrivacyBudget, default_state_dir
from lensemble_flwr.release.pipeline import (
    Release,
    ReleaseContext,
    ReleaseTransform,
    Stage,
    chain,
    no_state,
)
from lensemble_flwr.release.privacy import clip, gaussian_noise
from lensemble_flwr.release.quantize import int8_quantize

if TYPE_CHECKING:
    from lensemble_flwr.federation.alignment import GaugeSetup


def difference() -> ReleaseTransform:
    """Δ = local − global, name by name (float32); ``local`` is dropped afterwards."""

    def update(release: Release, state: Any, ctx: ReleaseContext) -> tuple[Release, Any]:
        if release.local is None:
            raise RoundError("difference: no local weights to difference")
        delta = subtract(release.local, ctx.global_state.params)
        return release.replace(local=None, delta=delta), state

    return ReleaseTransform("difference", Stage.DIFFERENCE, no_state, update)


def bind() -> ReleaseTransform:
    """Bind the release to the participant's dataset commitment (one root per release)."""

    def update(release: Release, state: Any, ctx: ReleaseContext) -> tuple[Release, Any]:
        if release.delta is None or release.local is not None:
            raise RoundError("bind: only a differenced delta can be bound")
        if release.bound_root is not None:
            raise RoundError("bind: release is already bound")
        if ctx.dataset_root is None:
            raise RoundError("bind: this participant has no dataset commitment to bind to")
        return release.replace(bound_root=ctx.dataset_root), state

    return ReleaseTransform("bind", Stage.BIND, no_state, update)


def release_pipeline(
    config: LensembleConfig,
    *,
    participant_id: str,
    dataset_root: str | None,
    gauge: GaugeSetup | None = None,
) -> ReleaseTransform:
    """The participant's pipeline as its config asks:
    [align →] difference → [clip → [noise]] → [quantize] → bind.

    Alignment (``gauge-align``) rotates the trained weights into the global latent frame
    before they are differenced, so every later stage sees the aligned delta.

    The privacy budget belongs to the dataset commitment (or, for a participant that
    cannot commit, to its id) and lives in the participant's ``dp-state-dir``.
    """
    privacy = config.privacy
    stages: list[ReleaseTransform] = []
    if config.gauge.align:
        if gauge is None:
            raise ConfigError("gauge-align", "needs a GaugeSetup (the model's adapter and probe)")
        from lensemble_flwr.gauge import align  # the gauge package builds on this one

        stages.append(align(gauge.adapter, gauge.probe, config.gauge))
    stages.append(difference())
    if privacy.clip_norm > 0:
        stages.append(clip(privacy.clip_norm))
    if privacy.noised:
        budget = PrivacyBudget(
            privacy.dp_state_dir or default_state_dir(),
            dataset_root or f"participant-{participant_id}",
            epsilon=privacy.dp_epsilon,
            delta=privacy.dp_delta,
            accountant=privacy.dp_accountant,
        )
        stages.append(gaussian_noise(privacy.noise_multiplier, privacy.clip_norm, budget))
    if config.release.quantize == "int8":
        stages.append(int8_quantize())
    if dataset_root is not None:
        stages.append(bind())
    return chain(*stages)
