"""Orthogonal Procrustes: the rotation (or reflection) that best maps one frame onto another.

Given local embeddings L and target embeddings T of the same probe (n × d), the
orthogonal Q minimising ``||L Q − T||_F`` is ``Q = U Vᵀ`` for the SVD ``M = U S Vᵀ`` of
the cross-covariance ``M = Lᵀ T`` (d × d). Q ranges over all of O(d), reflections included:
the world model's loss is invariant under every orthogonal change of latent frame, so a
reflected frame is as much a gauge copy as a rotated one, and forcing det Q = +1 would
leave a reflected participant misaligned.

Conditioning. Q is determined by M only as well as M's smallest singular value allows: a
direction in which the local embeddings carry no probe signal (a collapsed latent
dimension, too few probe rows) has σ_min ≈ 0 and any rotation of it fits equally well.
The condition number κ = σ_max / σ_min measures this. Above ``max_condition`` the rule is

* ``"refuse"``: raise :class:`DegenerateProcrustes`;
* ``"ridge"``: solve instead ``min_Q ||L Q − T||² + λ σ_max ||Q − I||²``. Since
  ``||Q − I||² = 2d − 2 tr Q`` for orthogonal Q, that is the SVD of ``M + λ σ_max I``:
  the ridge shrinks Q towards "no rotation" in exactly the directions the probe does not
  determine, and leaves well-determined directions almost untouched. If ``M + λ σ_max I``
  is still ill-conditioned (M has no signal at all, or a reflection cancels the ridge),
  raise :class:`DegenerateProcrustes`.

A participant that gets the error releases nothing for the round.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lensemble_flwr.errors import ConfigError, DegenerateProcrustes

CONDITIONING_RULES = ("ridge", "refuse")


@dataclasses.dataclass(frozen=True, eq=False)
class Alignment:
    """The solution of one Procrustes problem.

    Attributes:
        q: d × d orthogonal (float64), minimising ``||local @ q − target||_F``.
        condition: σ_max / σ_min of the cross-covariance ``localᵀ target`` (before any
            ridge; ``inf`` if it is singular).
        residual_before: ``||local − target||_F / ||target||_F``.
        residual_after: ``||local @ q − target||_F / ||target||_F``.
        conditioned: whether the ridge rule was applied.
    """

    q: np.ndarray
    condition: float
    residual_before: float
    residual_after: float
    conditioned: bool


def _condition(singular: np.ndarray) -> float:
    smallest, largest = float(singular[-1]), float(singular[0])
    if largest <= 0.0 or smallest <= 0.0:
        return float("inf")
    return largest / smallest


def _well_conditioned(condition: float, max_condition: float) -> bool:
    # written so that an infinite condition never passes, even against max_condition=inf
    return np.isfinite(condition) and condition <= max_condition


def procrustes_align(
    local: np.ndarray,
    target: np.ndarray,
    *,
    max_condition: float,
    conditioning: str = "ridge",
    ridge: float = 1e-3,
) -> Alignment:
    """The orthogonal Q minimising ``||local @ q − target||_F`` (see the module docstring).

    Args:
        local: n × d embeddings in the frame to be rotated.
        target: n × d embeddings of the same inputs in the target frame.
        max_condition: largest accepted σ_max / σ_min of ``localᵀ target``.
        conditioning: ``"ridge"`` (regularise towards the identity and retry once) or
            ``"refuse"``.
        ridge: λ, relative to σ_max.

    Raises:
        DegenerateProcrustes: non-finite or mis-shaped inputs, a zero target, or a
            cross-covariance above ``max_condition`` (after the ridge, under "ridge").
        ConfigError: an unknown conditioning rule, ``ridge <= 0`` or ``max_condition <= 1``.
    """
    if conditioning not in CONDITIONING_RULES:
        raise ConfigError(
            "gauge.conditioning", f"one of {CONDITIONING_RULES}, got {conditioning!r}"
        )
    if not ridge > 0:
        raise ConfigError("gauge.ridge", f"must be > 0, got {ridge}")
    if not max_condition > 1:
        raise ConfigError("gauge.max_condition", f"must be > 1, got {max_condition}")
    local64 = np.asarray(local, dtype=np.float64)
    target64 = np.asarray(target, dtype=np.float64)
    if local64.ndim != 2 or local64.shape != target64.shape or 0 in local64.shape:
        raise DegenerateProcrustes(
            f"local and target must be n x d of the same shape, got {local64.shape} and "
            f"{target64.shape}"
        )
    if not (np.all(np.isfinite(local64)) and np.all(np.isfinite(target64))):
        raise DegenerateProcrustes("non-finite probe embeddings")
    target_norm = float(np.linalg.norm(target64))
    if target_norm == 0.0:
        raise DegenerateProcrustes("the target embeddings are all zero")

    cross = local64.T @ target64  # (d, d)
    u, s, vt = np.linalg.svd(cross)
    condition = _condition(s)
    conditioned = False
    if not _well_conditioned(condition, max_condition):
        if conditioning == "refuse":
            raise DegenerateProcrustes(
                f"cross-covariance condition {condition:.3g} exceeds {max_condition:.3g}"
            )
        regularised = cross + ridge * float(s[0]) * np.eye(cross.shape[0])
        u, s_ridge, vt = np.linalg.svd(regularised)
        after = _condition(s_ridge)
        if not _well_conditioned(after, max_condition):
            raise DegenerateProcrustes(
                f"cross-covariance condition {condition:.3g} exceeds {max_condition:.3g}, "
                f"and still {after:.3g} with a ridge of {ridge:g} x sigma_max"
            )
        conditioned = True
    q = u @ vt
    return Alignment(
        q=q,
        condition=condition,
        residual_before=float(np.linalg.norm(local64 - target64)) / target_norm,
        residual_after=float(np.linalg.norm(local64 @ q - target64)) / target_norm,
        conditioned=conditioned,
    )
