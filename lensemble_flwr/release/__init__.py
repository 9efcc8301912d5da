"""The participant's release chain: small composable stages, enforced in order.

align (``gauge``) → difference → clip → noise → quantize → mask → bind; one module per
stage, composed by :func:`chain` (``pipeline``).
"""

from lensemble_flwr.release.accounting import PrivacyState
from lensemble_flwr.release.binding import bind
from lensemble_flwr.release.clipping import clip
from lensemble_flwr.release.differencing import difference
from lensemble_flwr.release.masking import mask
from lensemble_flwr.release.noise import distributed_noise, gaussian_noise
from lensemble_flwr.release.pipeline import (
    ChainState,
    Release,
    ReleaseContext,
    ReleaseTransform,
    Stage,
    chain,
)
from lensemble_flwr.release.quantize import int8_quantize

__all__ = [
    "ChainState",
    "PrivacyState",
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
    "int8_quantize",
    "mask",
]
