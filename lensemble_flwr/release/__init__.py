"""The participant's release pipeline: small composable transforms, enforced in order."""

from lensemble_flwr.release.pipeline import (
    Release,
    ReleaseContext,
    ReleaseTransform,
    Stage,
    chain,
)
from lensemble_flwr.release.stages import bind, default_pipeline, difference

__all__ = [
    "Release",
    "ReleaseContext",
    "ReleaseTransform",
    "Stage",
    "bind",
    "chain",
    "default_pipeline",
    "difference",
]
