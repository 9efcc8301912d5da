"""Distributed discrete Gaussian noise for sums revealed by secure aggregation.

The mechanism. Each member of a masked round clips its update to L2 norm C, puts it on
the fixed-point integer grid (value times ``scale`` = 2**F, rounded half-to-even) and adds
its own integer noise share drawn from the discrete Gaussian N_Z(0, σ²): the distribution
on the integers with P[x] proportional to exp(-x²/(2σ²)). Secure aggregation reveals only
the sum. The sum of discrete Gaussians is not itself a discrete Gaussian, but it is very
close to one, and the sum of any n ≥ t surviving shares carries noise of variance about
n·σ² (for σ ≥ 1 the variance of N_Z(0, σ²) is σ² up to a relative 3e-7; from σ = 1.5 on,
to float64 precision).

Sources.

- Sampling: Canonne, Kamath and Steinke, "The Discrete Gaussian for Differential
  Privacy" (NeurIPS 2020, arXiv:2004.00010), Algorithm 3: propose Y from the discrete
  Laplace distribution with scale t = floor(σ) + 1 (P[y] proportional to exp(-|y|/t)) and
  keep it with probability exp(-(|Y| - σ²/t)²/(2σ²)); the kept values are exactly
  N_Z(0, σ²). The same paper shows that one discrete Gaussian on an integer query of L2
  sensitivity Δ is (Δ²/(2σ²))-zCDP.
- The sum: Kairouz, Liu and Steinke, "The Distributed Discrete Gaussian Mechanism for
  Federated Learning with Secure Aggregation" (ICML 2021, arXiv:2102.06387), Theorem 1
  and its Proposition 14 (the Rényi bound behind it), valid for σ ≥ 1/2. The formula used
  here is the one of the authors' reference implementation, google-research/federated,
  ``distributed_dp/accounting_utils.py`` (``compute_rdp_dgaussian`` and the τ loop of
  ``ddgauss_epsilon``): with τ = 10·Σ_{k=1}^{n-1} exp(-2π²σ²·k/(k+1)), the Rényi
  divergence of order α of the sum of n shares is at most
  min(α·Δ²/(2nσ²) + τd, (α/2)·(Δ/(√n·σ) + τ√d)²). See :func:`ddg_sum_rho` for what this
  means as zCDP.

The floating-point caveat. CKS20 give an exact sampler in integer and rational arithmetic.
This one is vectorised numpy in float64 (as the authors' own TensorFlow sampler is), built
so that the error stays pointwise tiny even at σ ~ 2**44. The obvious inversion of one
53-bit uniform into a geometric of scale t = 2**44 would give each integer only ~2**9
grid points of the uniform (a 0.2% error on every probability, repeated in every
coordinate); instead the discrete Laplace magnitude is split as R + t·V (CKS20's
Algorithm 2): R exactly uniform on {0, ..., t-1} from 64-bit ChaCha20 words, kept with
probability exp(-R/t), and V geometric of scale 1 by inversion. What float64 still
changes: every Bernoulli and inversion step is off by about 2**-53 in absolute
probability, so the output pmf is within a relative 1e-13 of N_Z(0, σ²) for |y| up to
about 4σ, and the relative error grows like 1e-16·exp(y²/(2σ²)) beyond; and the
acceptance test can never pass once exp(-(|Y| - σ²/t)²/(2σ²)) is below the smallest
uniform (2**-53), so values beyond about σ²/t + 8.57σ never occur. That truncated tail has
mass below 1e-17 per coordinate: an additive δ-like slack outside the zCDP accounting,
negligible but not zero. The released values are integers, so unlike floating-point
continuous Gaussian noise (Mironov, CCS 2012) no low-order bits of a float expose the
noiseless value. All randomness comes from the ChaCha20 source of
:mod:`lensemble_flwr.privacy.gaussian` (keyed from ``os.urandom``): its
:func:`~lensemble_flwr.privacy.gaussian.secure_uniform` for the float uniforms, and its
raw keystream for the integer ones; never numpy's generators.
"""

from __future__ import annotations

import math

import numpy as np

from lensemble_flwr.privacy.gaussian import _keystream, secure_uniform

MIN_SIGMA = 1.0
"""The smallest σ (grid units) :func:`secure_discrete_gaussian` accepts."""

MAX_SIGMA = float(2**47)
"""The largest σ (grid units) :func:`secure_discrete_gaussian` accepts: the proposal's
magnitudes (below 38·t, t = floor(σ) + 1) must stay below 2**53, where float64 still holds every
integer exactly."""

MIN_ACCOUNTED_SIGMA = 0.5
"""The smallest share σ for which the bound of :func:`ddg_sum_rho` holds (KLS21)."""

_TWO_PI_SQUARED = 2.0 * math.pi**2
_EXP_UNDERFLOW = 746.0  # exp(-x) is exactly 0.0 in float64 beyond this


def _check_sigma(sigma: float) -> float:
    sigma = float(sigma)
    if not math.isfinite(sigma):
        raise ValueError(f"sigma must be finite, got {sigma!r}")
    if sigma < MIN_SIGMA:
        raise ValueError(
            f"sigma must be at least {MIN_SIGMA} grid unit, got {sigma!r}: below one unit "
            "the discrete Gaussian's variance falls visibly short of sigma**2 (the total "
            "noise the sum is promised), and the distributed bound's tau term grows "
            "until the sum of shares protects nothing"
        )
    if sigma > MAX_SIGMA:
        raise ValueError(
            f"sigma must be at most 2**47 grid units, got {sigma!r}: beyond that the "
            "float64 sampler can no longer hold every proposed integer exactly"
        )
    return sigma


def _words(size: int) -> np.ndarray:
    """``size`` uniform 64-bit words from a freshly keyed ChaCha20 stream."""
    return np.frombuffer(_keystream(8 * size), dtype="<u8")


def _laplace_trial(size: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """One trial of CKS20's Algorithm 2 for each of ``size`` entries: proposals Y with
    P[y] proportional to exp(-|y|/t), and whether each trial succeeded.

    Magnitude X = R + t·V. R is uniform on {0, ..., t-1} (a 64-bit word below the
    largest multiple of t, reduced mod t: exact; a word above fails the trial) and kept
    with probability exp(-R/t), so that P[R = r] is proportional to exp(-r/t). V is
    geometric with P[V ≥ v] = exp(-v), by inversion, V = floor(-log U): its steps have
    probabilities of order 1, and nothing like 1 - exp(-1/t) is ever computed (the
    cancellation log1p/expm1 would otherwise be needed for). Then a fair sign, refusing
    -0 so that 0 is not counted twice. Failed trials are drawn again by the caller.
    """
    top = 2**64 - 1 - 2**64 % t  # the largest word below the largest multiple of t
    w = _words(size)
    u = secure_uniform(3 * size)
    r = (w % np.uint64(t)).astype(np.int64)
    ok = (w <= np.uint64(top)) & (u[:size] < np.exp(-r / t))
    v = np.floor(-np.log(u[size : 2 * size])).astype(np.int64)
    x = r + t * v
    negative = u[2 * size :] < 0.5  # exactly 1/2: secure_uniform's values below 0.5 are exact
    ok &= ~(negative & (x == 0))
    return np.where(negative, -x, x), ok


def secure_discrete_gaussian(shape: tuple[int, ...], sigma: float) -> np.ndarray:
    """Integer noise from the discrete Gaussian N_Z(0, σ²), int64, CSPRNG-driven.

    CKS20's Algorithm 3, vectorised: every entry proposes a discrete Laplace value Y with
    scale t = floor(σ) + 1 (Algorithm 2, see the module docstring) and keeps it with
    probability exp(-(|Y| - σ²/t)²/(2σ²)); only the rejected entries are drawn again
    (on average about 2 trials per entry, 2.9 at σ = 1). Every float uniform comes from
    :func:`lensemble_flwr.privacy.gaussian.secure_uniform`, every integer one from the
    same ChaCha20 source.

    Args:
        shape: the shape of the returned array.
        sigma: the scale σ in grid units, from 1 to 2**47.

    Returns:
        An int64 array of ``shape`` with independent N_Z(0, σ²) entries.

    Raises:
        ValueError: σ is not finite, below 1 or above 2**47, or ``shape`` is not a tuple of
            non-negative integers.
    """
    sigma = _check_sigma(sigma)
    dims = tuple(int(s) for s in shape)
    if any(s < 0 for s in dims):
        raise ValueError(f"shape must hold non-negative sizes, got {shape!r}")
    size = math.prod(dims)
    t = math.floor(sigma) + 1
    centre = sigma * sigma / t  # the acceptance weight peaks where |Y| = σ²/t
    out = np.empty(size, dtype=np.int64)
    pending = np.arange(size)
    while pending.size:
        m = pending.size
        proposal, keep = _laplace_trial(m, t)
        excess = (np.abs(proposal).astype(np.float64) - centre) / sigma
        keep &= secure_uniform(m) < np.exp(-0.5 * excess * excess)
        out[pending[keep]] = proposal[keep]
        pending = pending[~keep]
    return out.reshape(dims)


def _check_positive_int(name: str, value: int) -> int:
    if int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def ddg_sum_rho(l2_sensitivity: float, sigma: float, n: int, dim: int) -> float:
    """The zCDP ρ of adding the sum of ``n`` independent N_Z(0, σ²)^dim shares to an
    integer vector of L2 sensitivity Δ = ``l2_sensitivity``.

    KLS21 (Theorem 1, Proposition 14; the reference implementation is
    google-research/federated ``distributed_dp/accounting_utils.py``) bound the Rényi
    divergence of order α of the sum of m shares by

        min(α·Δ²/(2mσ²) + τ_m·d, (α/2)·(Δ/(√m·σ) + τ_m·√d)²),
        τ_m = 10·Σ_{k=1}^{m-1} exp(-2π²σ²·k/(k+1)).

    The second term is α times a constant; the first, divided by α, is largest as α → 1.
    So the sum is ρ_m-zCDP (Rényi divergence ≤ α·ρ_m for every α > 1) with

        ρ_m = min(Δ²/(2mσ²) + τ_m·d, (Δ/(√m·σ) + τ_m·√d)²/2) = ε²/2,
        ε = min(sqrt(Δ²/(mσ²) + 2τ_m·d), Δ/(√m·σ) + τ_m·√d).

    (Mind the constant: 2τd, as the reference implementation's RDP curve implies at
    α → 1; a version of the theorem quoted with τd/2 would under-charge when τ matters.)

    The sum of n shares is the sum of any m ≤ n of them plus independent noise, i.e. a
    post-processing of it, so the returned value is min over m ≤ n of ρ_m: it never
    increases with n (τ_m alone grows with m, and for small σ and large n would otherwise
    make the bound grow). It decreases as σ grows, and tends to Δ²/(2nσ²), the value of a
    single discrete Gaussian of variance nσ², as τ → 0 (τ is exactly 0.0 in float64 once
    σ ≳ 8.7, being below the smallest double).

    Args:
        l2_sensitivity: Δ, in grid units (see :func:`grid_l2_sensitivity`).
        sigma: each share's σ in grid units, at least 1/2.
        n: the number of shares in the sum (the secure-aggregation threshold t gives the
            guarantee for any ≥ t survivors).
        dim: d, the number of coordinates.

    Raises:
        ValueError: a non-finite or negative Δ, σ < 1/2, or n, dim not positive integers.
    """
    delta = float(l2_sensitivity)
    sigma = float(sigma)
    if not (math.isfinite(delta) and delta >= 0):
        raise ValueError(f"l2_sensitivity must be finite and >= 0, got {l2_sensitivity!r}")
    if not (math.isfinite(sigma) and sigma >= MIN_ACCOUNTED_SIGMA):
        raise ValueError(f"sigma must be finite and >= 1/2 (the bound's condition), got {sigma!r}")
    n = _check_positive_int("n", n)
    d = _check_positive_int("dim", dim)
    exponent = _TWO_PI_SQUARED * sigma * sigma
    if n == 1 or exponent / 2.0 > _EXP_UNDERFLOW:
        return delta * delta / (2.0 * n * sigma * sigma)  # τ is 0 (exactly, or in float64)
    k = np.arange(1, n, dtype=np.float64)
    tau = np.concatenate([[0.0], 10.0 * np.cumsum(np.exp(-exponent * k / (k + 1.0)))])
    m = np.arange(1, n + 1, dtype=np.float64)
    scale = delta / (np.sqrt(m) * sigma)  # Δ/(√m·σ) for m = 1..n
    rho = np.minimum(0.5 * scale**2 + tau * d, 0.5 * (scale + tau * math.sqrt(d)) ** 2)
    return float(rho.min())


def share_sigma(
    target_noise_multiplier: float, l2_sensitivity: float, threshold: int, dim: int
) -> float:
    """The smallest share σ (grid units) whose ``threshold`` shares protect the sum at
    least as well as a continuous Gaussian of std ``target_noise_multiplier`` × Δ.

    That Gaussian is ρ-zCDP with ρ = 1/(2z²) (z = ``target_noise_multiplier``); this
    returns the smallest σ with ``ddg_sum_rho(Δ, σ, threshold, dim)`` ≤ 1/(2z²), τ term
    included, by bisection from z·Δ/√threshold (the answer when τ is negligible) to the
    precision of float64. The answer is at least 1 (what :func:`secure_discrete_gaussian`
    accepts; more noise never hurts privacy). Since ρ does not increase with the number of
    shares, the guarantee holds for any number ≥ ``threshold`` of surviving shares.

    Args:
        target_noise_multiplier: z > 0, relative to Δ.
        l2_sensitivity: Δ > 0, in grid units.
        threshold: the number of shares t every revealed sum has at least.
        dim: the number of coordinates.

    Raises:
        ValueError: non-positive or non-finite z or Δ, or threshold, dim not positive
            integers.
    """
    z = float(target_noise_multiplier)
    delta = float(l2_sensitivity)
    if not (math.isfinite(z) and z > 0):
        raise ValueError(f"target_noise_multiplier must be finite and > 0, got {z!r}")
    if not (math.isfinite(delta) and delta > 0):
        raise ValueError(f"l2_sensitivity must be finite and > 0, got {delta!r}")
    t = _check_positive_int("threshold", threshold)
    d = _check_positive_int("dim", dim)
    target = 1.0 / (2.0 * z * z)

    def ok(sigma: float) -> bool:
        return ddg_sum_rho(delta, sigma, t, d) <= target

    lo = max(MIN_SIGMA, z * delta / math.sqrt(t))
    if ok(lo):
        return lo
    hi = 2.0 * lo
    while not ok(hi):
        lo, hi = hi, 2.0 * hi
    while hi - lo > 4.0 * math.ulp(hi):
        mid = 0.5 * (lo + hi)
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def grid_l2_sensitivity(
    clip_norm: float, scale: float, dim: int, *, sensitivity_factor: float = 2.0
) -> float:
    """The L2 sensitivity on the integer grid of one participant's clipped, encoded
    update when its whole dataset is substituted: 2·(C·scale + √dim/2); with
    ``sensitivity_factor`` 1 (zero-out adjacency: the neighbouring update is the zero
    vector, whose encoding is exact), C·scale + √dim/2.

    Either dataset's update x is clipped to ‖x‖₂ ≤ C and encoded as round(x·scale),
    rounded deterministically (half-to-even). Each coordinate moves by at most 1/2, so
    the rounding error has norm at most √dim/2 and ‖round(x·scale)‖₂ ≤ C·scale + √dim/2.
    The two encodings differ by at most twice that (triangle inequality). The bound is
    reached up to rounding: x = (C/√d, ..., C/√d) with C·scale/√d just above a half
    integer, against -x. The difference is an integer vector, as KLS21's bound requires.

    The clip must hold exactly for the values that are encoded: a float clip by the factor
    C/‖x‖ can overshoot C by a few ulps, which at scale 2**32 is already many grid units;
    clip with a margin or check the encoded vector's integer norm.

    Args:
        clip_norm: C ≥ 0, in the update's own units.
        scale: the grid's units per unit of the update (2**F), > 0.
        dim: the number of coordinates.
        sensitivity_factor: 2 (substitution) or 1 (zero-out).

    Raises:
        ValueError: a negative or non-finite C, a non-positive or non-finite scale, dim
            not a positive integer, or a factor other than 1 or 2.
    """
    if sensitivity_factor not in (1.0, 2.0):
        raise ValueError(f"sensitivity_factor must be 1 or 2, got {sensitivity_factor!r}")
    c = float(clip_norm)
    s = float(scale)
    if not (math.isfinite(c) and c >= 0):
        raise ValueError(f"clip_norm must be finite and >= 0, got {clip_norm!r}")
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"scale must be finite and > 0, got {scale!r}")
    d = _check_positive_int("dim", dim)
    return float(sensitivity_factor) * (c * s + math.sqrt(d) / 2.0)


def equivalent_noise_multiplier(rho: float) -> float:
    """The noise multiplier 1/√(2ρ) of the Gaussian mechanism whose Rényi curve, without
    subsampling, is exactly that of ρ-zCDP.

    A Gaussian of std z times the sensitivity has Rényi divergence α/(2z²) at every order
    α, so z = 1/√(2ρ) gives α·ρ: a ρ-zCDP release can be charged to an Opacus accountant
    as the history entry ``(z, 1.0, steps)``. Note that
    :meth:`lensemble_flwr.privacy.budget.PrivacyBudget.charge` by default takes std / clip
    norm and divides it by the budget's sensitivity factor (2 under substitution, 1 under
    zero-out); ρ from :func:`ddg_sum_rho` already includes the sensitivity, so z must be
    charged with ``sensitivity_factor=1.0``, or the release is under-counted.

    Raises:
        ValueError: ρ is not finite and > 0.
    """
    rho = float(rho)
    if not (math.isfinite(rho) and rho > 0):
        raise ValueError(f"rho must be finite and > 0, got {rho!r}")
    return 1.0 / math.sqrt(2.0 * rho)
