"""The participant's release chain, built from its config: which stages, in which order.

The stages themselves are small transforms (:mod:`lensemble_flwr.release`, and the
alignment stage of :mod:`lensemble_flwr.gauge`); this module only composes them.
"""

from __future__ import annotations

import hashlib
import re

from lensemble_flwr.config import LensembleConfig, default_state_dir
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.gauge.runtime import GaugeSetup
from lensemble_flwr.gauge.stage import align
from lensemble_flwr.privacy.budget import PrivacyBudget
from lensemble_flwr.privacy.calibration import noise_multiplier_of
from lensemble_flwr.release.binding import bind
from lensemble_flwr.release.clipping import clip
from lensemble_flwr.release.differencing import difference
from lensemble_flwr.release.masking import mask
from lensemble_flwr.release.noise import distributed_noise, gaussian_noise
from lensemble_flwr.release.pipeline import ReleaseTransform, Stage, chain
from lensemble_flwr.release.quantize import int8_quantize


def budget_name(identity: str) -> str:
    """The name a participant's budget file is kept under: its identity when that is a
    plain name, else a hash of it (identities are free text; file names are not)."""
    if re.fullmatch(r"[A-Za-z0-9._-]{1,100}", identity) and identity not in (".", ".."):
        return f"participant-{identity}"
    return f"participant-{hashlib.sha256(identity.encode()).hexdigest()[:32]}"


def release_pipeline(
    config: LensembleConfig,
    *,
    participant_id: str,
    dataset_root: str | None,
    gauge: GaugeSetup | None = None,
    budget_key: str | None = None,
) -> ReleaseTransform:
    """The participant's pipeline as its config asks:
    [align →] difference → [clip → [noise]] → [quantize] → [mask] → [bind].

    Alignment (``gauge-align``) rotates the trained weights into the global latent frame
    before they are differenced, so every later stage sees the aligned delta.

    The privacy budget belongs to the participant's stable identity (``budget_key``;
    default: its id), never to its data: new or changed data does not reset it. It lives
    in the participant's ``dp-state-dir``.
    """
    privacy = config.privacy
    stages: list[ReleaseTransform] = []
    if config.gauge.align:
        if gauge is None:
            raise ConfigError("gauge-align", "needs a GaugeSetup (the model's adapter and probe)")
        stages.append(align(gauge.adapter, gauge.probe, config.gauge))
    stages.append(difference())
    if privacy.clip_norm > 0:
        stages.append(clip(privacy.clip_norm))
    if privacy.noised:
        budget = PrivacyBudget(
            privacy.dp_state_dir or default_state_dir(),
            budget_name(budget_key or participant_id),
            epsilon=privacy.dp_epsilon,
            delta=privacy.dp_delta,
            accountant=privacy.dp_accountant,
            adjacency=privacy.dp_adjacency,
        )
        noise = noise_multiplier_of(config)  # explicit, or calibrated to the plan
        if privacy.distributed:  # a share, added in the masks' integer domain
            stages.append(
                distributed_noise(
                    noise,
                    privacy.clip_norm,
                    fraction_bits=config.aggregation.fraction_bits,
                    threshold=config.federation.secagg_threshold,
                    budget=budget,
                )
            )
        else:
            stages.append(gaussian_noise(noise, privacy.clip_norm, budget))
    if config.release.quantize == "int8":
        stages.append(int8_quantize())
    if config.federation.masked:
        stages.append(mask(config))
    if dataset_root is not None:
        stages.append(bind())
    return chain(*stages)


def with_mask(pipeline: ReleaseTransform, config: LensembleConfig) -> ReleaseTransform:
    """``pipeline`` with the mask stage where the order puts it (before bind), when the
    federation masks and the pipeline (a custom one) has none; else ``pipeline`` itself.

    Raises:
        ConfigError: the stage cannot be placed in the pipeline's order.
    """
    parts = pipeline.parts or (pipeline,)
    if not config.federation.masked or _has_stage(pipeline, Stage.MASK):
        return pipeline
    at = next((i for i, part in enumerate(parts) if part.stage > Stage.MASK), len(parts))
    return chain(*parts[:at], mask(config), *parts[at:])


def _has_stage(transform: ReleaseTransform, stage: Stage) -> bool:
    if transform.parts:
        return any(_has_stage(part, stage) for part in transform.parts)
    return transform.stage is stage
