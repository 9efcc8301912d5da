"""The participant's release pipeline: small composable transforms, enforced in order."""

from lensemble_flwr.release.pipeline import (
    Release,
    ReleaseContext,
    ReleaseTransform,
    Stage,
    chain,
)
from lensemble_flwr.release.privacy import clip, distributed_noise, gaussian_noise
from lensemble_flwr.release.stages import bind, difference

__all__ = [
    "Release",
    "ReleaseContext",
    "ReleaseTransform",
    "Stage",
    "bind",
    "chain",
    "clip",
    "difference",
    "distributed_noise",
    "gaussian_noise",
]
