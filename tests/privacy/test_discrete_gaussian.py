"""Distributed discrete Gaussian noise (lensemble_flwr.privacy.discrete_gaussian).

The sampler against the exact pmf of N_Z(0, σ²) (moments, symmetry, chi-square, and that
the check can fail), its randomness source, and the accounting: the zCDP bound of the sum
against numbers from the authors' reference implementation, its monotonicity and limit,
the share σ that meets a continuous Gaussian's ρ, the grid sensitivity, and the claim that
ρ-zCDP is charged exactly as an unsampled Gaussian in Opacus.

Every statistical tolerance is computed from the sample size (6 standard errors, or a
chi-square quantile at p = 1e-9), so a correct sampler fails with negligible probability.
"""

from __future__ import annotations

import inspect
import itertools
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
from scipy import stats

from lensemble_flwr.privacy import discrete_gaussian as dg
from lensemble_flwr.privacy.budget import PrivacyBudget
from lensemble_flwr.privacy.discrete_gaussian import (
    ddg_sum_rho,
    equivalent_noise_multiplier,
    grid_l2_sensitivity,
    secure_discrete_gaussian,
    share_sigma,
)

P_FAIL = 1e-9  # the false-alarm probability of each chi-square check


def _pmf(sigma: float, ks: np.ndarray) -> np.ndarray:
    """The exact pmf of N_Z(0, σ²) at the integers ``ks`` (normaliser summed to ±60σ)."""
    half = int(60 * sigma) + 10
    normaliser = np.exp(-(np.arange(-half, half + 1, dtype=np.float64) ** 2) / (2 * sigma**2))
    return np.exp(-(ks.astype(np.float64) ** 2) / (2 * sigma**2)) / normaliser.sum()


def _exact_moments(sigma: float) -> tuple[float, float]:
    """E[Y²] and E[Y⁴] of N_Z(0, σ²): exact sums for small σ, σ² and 3σ⁴ for large σ
    (where they agree to float64 precision)."""
    if sigma > 20:
        return sigma**2, 3 * sigma**4
    ks = np.arange(-int(60 * sigma) - 10, int(60 * sigma) + 11)
    p = _pmf(sigma, ks)
    return float((p * ks**2.0).sum()), float((p * ks**4.0).sum())


def _chi_square(samples: np.ndarray, sigma: float) -> tuple[float, int]:
    """Pearson's statistic of ``samples`` against N_Z(0, σ²) and its degrees of freedom:
    one bin per integer in [-K, K], the two tails pooled, K as large as keeps each tail's
    expected count at least 10."""
    n = samples.size
    k = 1
    while n * (_pmf(sigma, np.arange(k + 1, k + 60 * int(sigma) + 60)).sum()) >= 10:
        k += 1
    k -= 1
    inner = np.arange(-k, k + 1)
    tail = (1.0 - _pmf(sigma, inner).sum()) / 2
    expected = n * np.concatenate([[tail], _pmf(sigma, inner), [tail]])
    observed = np.concatenate(
        [
            [np.count_nonzero(samples < -k)],
            np.bincount(samples[np.abs(samples) <= k] + k, minlength=2 * k + 1),
            [np.count_nonzero(samples > k)],
        ]
    )
    assert observed.sum() == n and expected.min() >= 5
    return float(((observed - expected) ** 2 / expected).sum()), expected.size - 1


# --- the sampler ---------------------------------------------------------------------


@pytest.mark.parametrize("sigma", [1.0, 1.5, 3.0, 37.5, 1e3, 1e10, 2.0**44, 2.0**47])
def test_moments_and_symmetry_match_the_discrete_gaussian(sigma: float) -> None:
    n = 100_000
    x = secure_discrete_gaussian((n,), sigma)
    assert x.dtype == np.int64 and x.shape == (n,)
    second, fourth = _exact_moments(sigma)
    f = x.astype(np.float64)
    assert abs(f.mean()) <= 6 * math.sqrt(second / n)
    # the mean is known (0), so mean(x²) estimates the variance with variance (μ4 - μ2²)/n
    assert abs((f * f).mean() - second) <= 6 * math.sqrt((fourth - second**2) / n)
    positive, negative = np.count_nonzero(x > 0), np.count_nonzero(x < 0)
    assert abs(positive - negative) <= 6 * math.sqrt(positive + negative)


@pytest.mark.parametrize("sigma", [1.5, 3.0])
def test_the_pmf_matches_the_exact_discrete_gaussian(sigma: float) -> None:
    statistic, df = _chi_square(secure_discrete_gaussian((300_000,), sigma), sigma)
    assert df >= 8
    assert statistic < stats.chi2.isf(P_FAIL, df)


def test_the_chi_square_check_can_fail() -> None:
    """A discrete Gaussian 10% too wide, or the right one shifted by 1, is refused by the
    same check."""
    wide = secure_discrete_gaussian((300_000,), 3.3)
    statistic, df = _chi_square(wide, 3.0)
    assert statistic > stats.chi2.isf(P_FAIL, df)
    shifted = secure_discrete_gaussian((300_000,), 1.5) + 1
    statistic, df = _chi_square(shifted, 1.5)
    assert statistic > stats.chi2.isf(P_FAIL, df)


def test_large_scales_hit_every_integer_evenly() -> None:
    """At σ = 2**44 every residue mod 64 occurs evenly: the low bits of the samples vary
    (a sampler that lost integer resolution at this scale, with values confined to a
    coarser lattice, fails this)."""
    n = 100_000
    low = secure_discrete_gaussian((n,), 2.0**44) % 64
    counts = np.bincount(low, minlength=64)
    statistic = float(((counts - n / 64) ** 2 / (n / 64)).sum())
    assert statistic < stats.chi2.isf(P_FAIL, 63)


@pytest.mark.parametrize("shape", [(), (0,), (7,), (2, 3, 4)])
def test_shapes_and_dtype(shape: tuple[int, ...]) -> None:
    x = secure_discrete_gaussian(shape, 2.5)
    assert x.shape == shape and x.dtype == np.int64


@pytest.mark.parametrize("sigma", [0.999, 0.5, 0.0, -1.0, math.nan, math.inf, 2.0**47 * 1.01])
def test_sigma_outside_the_valid_range_is_refused(sigma: float) -> None:
    with pytest.raises(ValueError, match="sigma"):
        secure_discrete_gaussian((3,), sigma)


def test_sigma_below_one_says_why() -> None:
    with pytest.raises(ValueError, match="variance falls visibly short"):
        secure_discrete_gaussian((3,), 0.9)


def test_the_extremes_of_the_range_are_accepted() -> None:
    assert secure_discrete_gaussian((10,), 1.0).dtype == np.int64
    assert secure_discrete_gaussian((10,), 2.0**47).dtype == np.int64


def test_a_negative_size_is_refused() -> None:
    with pytest.raises(ValueError, match="shape"):
        secure_discrete_gaussian((2, -1), 3.0)


def test_all_randomness_comes_from_the_csprng(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the module's two CSPRNG entry points replaced by a seeded stream, the output
    is reproducible: no other source of randomness is involved. With the real ones, it is
    not, whatever numpy's global seed."""

    def seeded(seed: int) -> None:
        rng = np.random.default_rng(seed)
        monkeypatch.setattr(dg, "secure_uniform", lambda n: rng.random(n) + 2.0**-54)
        monkeypatch.setattr(dg, "_words", lambda n: rng.integers(0, 2**64, n, dtype=np.uint64))

    seeded(7)
    a = secure_discrete_gaussian((1000,), 1e6)
    seeded(7)
    b = secure_discrete_gaussian((1000,), 1e6)
    assert np.array_equal(a, b)
    monkeypatch.undo()
    np.random.seed(0)
    c = secure_discrete_gaussian((1000,), 1e6)
    np.random.seed(0)
    d = secure_discrete_gaussian((1000,), 1e6)
    assert not np.array_equal(c, d)


def test_only_the_rejected_entries_are_drawn_again(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    real = dg.secure_uniform

    def recording(n: int) -> np.ndarray:
        sizes.append(n)
        return real(n)

    monkeypatch.setattr(dg, "secure_uniform", recording)
    n = 50_000
    secure_discrete_gaussian((n,), 4.2)
    trials = sizes[1::2]  # per round: 3m uniforms for the proposals, m for the acceptance
    assert sizes[0::2] == [3 * m for m in trials]
    assert trials[0] == n
    # never more; fewer whenever there are many (all of 100 entries rejected at once has
    # probability below 1e-25), and a lone entry may be rejected several times
    assert all(b < a if a >= 100 else b <= a for a, b in itertools.pairwise(trials))
    assert 1.5 * n < sum(trials) < 3 * n  # about two trials per entry


# --- the bound for the sum of shares -------------------------------------------------

# From the authors' reference implementation: google-research/federated, commit
# a5af8c4433c9ee2d2b1565f1bcc68c89e2000a6b, distributed_dp/accounting_utils.py, run on
# these inputs. ref_rho: compute_rdp_dgaussian_simplified(q=1, l2_scale=Δ/(√n·σ), tau,
# dim, steps=1, orders=[1]) with tau from the loop in ddgauss_epsilon (the RDP curve at
# α = 1, i.e. the zCDP ρ). ref_eps: ddgauss_epsilon(gamma=1, local_stddev=σ,
# num_clients=n, l2_sens=Δ, beta=0, dim, q=1, steps=10, delta=1e-5, l1_sens=Δ·√dim,
# rounding=False) at its RDP_ORDERS, 2..128 and 256 (its RDP-to-DP conversion is the
# same formula as Opacus's get_privacy_spent).
REFERENCE = [
    # (Δ, σ, n, dim, ref_rho, ref_eps)
    (1.0, 1.0, 10, 100, 0.05173354555030581, 4.839405614335113),
    (4.0, 1.0, 2, 1000, 4.046396388545395, 91.05455887475821),
    (2.0, 0.75, 5, 10, 0.906692795729741, 28.26048701844516),
    (10.0, 2.0, 100, 10000, 0.12500000000000355, 8.087861628831806),
    (3.0, 1.0, 1000, 50, 0.004892678023242312, 1.2934721922813532),
    (40.0, 1.0, 2, 100, 400.05172318620373, 8010.643862965887),
    (6.0, 0.6, 3, 4, 18.162596802939362, 358.41926579991065),
    (
        2 * 2.0**32 + math.sqrt(1000),
        2.0**32 * 1.2 / math.sqrt(8),
        8,
        1000,
        1.3888888991149324,
        37.90440908614899,
    ),
]
REFERENCE_ORDERS = np.array([*range(2, 129), 256], dtype=np.float64)


def _tau(sigma: float, n: int) -> float:
    return 10 * sum(math.exp(-2 * math.pi**2 * sigma**2 * k / (k + 1)) for k in range(1, n))


@pytest.mark.parametrize(("delta", "sigma", "n", "dim", "ref_rho", "ref_eps"), REFERENCE)
def test_rho_matches_the_reference_implementation(
    delta: float, sigma: float, n: int, dim: int, ref_rho: float, ref_eps: float
) -> None:
    rho = ddg_sum_rho(delta, sigma, n, dim)
    assert rho == pytest.approx(ref_rho, rel=1e-12)
    # ρ-zCDP charges α·ρ at every order, at least the reference's Rényi curve: the same
    # epsilon or a little more (more where the τ·d term, constant in α, is the smaller).
    with warnings.catch_warnings():  # Opacus warns when the best order is 2, the smallest
        warnings.simplefilter("ignore")
        rdp = REFERENCE_ORDERS * 10 * rho
        eps, _ = get_privacy_spent(orders=REFERENCE_ORDERS, rdp=rdp, delta=1e-5)
    assert ref_eps * (1 - 1e-12) <= eps <= 1.05 * ref_eps


@pytest.mark.parametrize(("delta", "sigma", "n", "dim", "ref_rho", "ref_eps"), REFERENCE)
def test_rho_is_half_the_square_of_the_theorems_epsilon(
    delta: float, sigma: float, n: int, dim: int, ref_rho: float, ref_eps: float
) -> None:
    """ε = min(sqrt(Δ²/(nσ²) + 2τd), Δ/(√n·σ) + τ√d), computed independently; with τd/2
    in place of 2τd (a misquotation of the theorem) the charge would be smaller."""
    tau = _tau(sigma, n)
    scale = delta / (math.sqrt(n) * sigma)
    eps = min(math.sqrt(scale**2 + 2 * tau * dim), scale + tau * math.sqrt(dim))
    rho = ddg_sum_rho(delta, sigma, n, dim)
    assert rho == pytest.approx(eps**2 / 2, rel=1e-12)
    misquoted = min(math.sqrt(scale**2 + tau * dim / 2), scale + tau * math.sqrt(dim)) ** 2 / 2
    assert rho >= misquoted


def test_rho_decreases_as_sigma_grows() -> None:
    sigmas = np.geomspace(0.5, 50.0, 40)
    for n, dim in [(1, 1), (5, 100), (50, 10_000)]:
        rhos = [ddg_sum_rho(4.0, s, n, dim) for s in sigmas]
        assert all(b < a for a, b in itertools.pairwise(rhos)), (n, dim)


def test_rho_never_increases_with_n_and_decreases_when_tau_is_negligible() -> None:
    small = [ddg_sum_rho(3.0, 0.5, n, 1000) for n in range(1, 60)]
    assert all(b <= a for a, b in itertools.pairwise(small))
    large = [ddg_sum_rho(3.0, 9.0, n, 1000) for n in range(1, 60)]
    assert all(b < a for a, b in itertools.pairwise(large))


def test_more_shares_are_post_processing_of_fewer() -> None:
    """At σ = 1/2 the τ term of the n-share bound grows with n; the returned ρ is the best
    bound over any m ≤ n shares (the others are independent noise added afterwards)."""
    delta, sigma, dim = 3.0, 0.5, 1000

    def bound(m: int) -> float:
        tau, scale = _tau(sigma, m), delta / (math.sqrt(m) * sigma)
        return min(scale**2 / 2 + tau * dim, (scale + tau * math.sqrt(dim)) ** 2 / 2)

    assert bound(40) > bound(2)  # the raw bound does grow
    assert ddg_sum_rho(delta, sigma, 40, dim) == pytest.approx(min(map(bound, range(1, 41))))


def test_rho_tends_to_the_single_gaussian_value_as_tau_vanishes() -> None:
    for n, dim in [(2, 10), (10, 10_000), (1000, 10**6)]:
        rho = ddg_sum_rho(5.0, 3.0, n, dim)
        assert rho == pytest.approx(25.0 / (2 * n * 9.0), rel=1e-12)
        assert ddg_sum_rho(5.0, 1e9, n, dim) == 25.0 / (2 * n * 1e18)
    # while at σ = 1 the τ term is visible
    assert ddg_sum_rho(5.0, 1.0, 10, 10_000) > 1.01 * 25.0 / (2 * 10)


@pytest.mark.parametrize(
    "args",
    [
        (1.0, 0.49, 3, 10),
        (math.nan, 1.0, 3, 10),
        (-1.0, 1.0, 3, 10),
        (1.0, math.inf, 3, 10),
        (1.0, 1.0, 0, 10),
        (1.0, 1.0, 2.5, 10),
        (1.0, 1.0, 3, 0),
    ],
)
def test_ddg_sum_rho_refuses_bad_arguments(args: tuple[float, float, int, int]) -> None:
    with pytest.raises(ValueError):
        ddg_sum_rho(*args)


# --- the share sigma -----------------------------------------------------------------


def test_share_sigma_without_tau_is_the_continuous_split() -> None:
    dim, t, z = 1000, 8, 1.1
    delta = grid_l2_sensitivity(1.0, 2.0**32, dim)
    sigma = share_sigma(z, delta, t, dim)
    assert sigma == pytest.approx(z * delta / math.sqrt(t), rel=1e-12)
    assert ddg_sum_rho(delta, sigma, t, dim) <= 1 / (2 * z * z)


def test_share_sigma_pays_for_tau_and_is_the_smallest() -> None:
    z, delta, t, dim = 1.0, 5.0, 20, 100_000
    sigma = share_sigma(z, delta, t, dim)
    target = 1 / (2 * z * z)
    assert sigma > max(1.0, z * delta / math.sqrt(t))  # τ costs extra noise here
    assert ddg_sum_rho(delta, sigma, t, dim) <= target
    assert ddg_sum_rho(delta, sigma * (1 - 1e-9), t, dim) > target
    # more survivors than the threshold: never worse
    assert ddg_sum_rho(delta, sigma, 3 * t, dim) <= target


def test_share_sigma_is_at_least_one_grid_unit() -> None:
    assert share_sigma(0.5, 1.0, 100, 1) == 1.0
    secure_discrete_gaussian((3,), share_sigma(0.5, 1.0, 100, 1))


@pytest.mark.parametrize(
    "args", [(0.0, 1.0, 2, 3), (math.nan, 1.0, 2, 3), (1.0, 0.0, 2, 3), (1.0, 1.0, 0, 3)]
)
def test_share_sigma_refuses_bad_arguments(args: tuple[float, float, int, int]) -> None:
    with pytest.raises(ValueError):
        share_sigma(*args)


# --- the grid sensitivity ------------------------------------------------------------


def _encode(x: np.ndarray, scale: float) -> np.ndarray:
    return np.rint(x * scale).astype(np.int64)  # numpy's rint rounds half to even


def test_grid_sensitivity_formula() -> None:
    assert grid_l2_sensitivity(1.0, 2.0**32, 100) == 2 * (2.0**32 + 5.0)
    assert grid_l2_sensitivity(0.0, 8.0, 4) == 2.0


def test_grid_sensitivity_is_reached_by_rounding_up_every_coordinate() -> None:
    """x = (c, ..., c) with c·scale just above a half integer, against -x: every
    coordinate rounds away from 0, and the √d/2 term is needed."""
    dim, scale = 400, 2.0**8
    c = (37.5 + 1e-6) / scale
    clip = c * math.sqrt(dim)
    x = np.full(dim, c)
    diff = _encode(x, scale) - _encode(-x, scale)
    actual = float(np.linalg.norm(diff.astype(np.float64)))
    bound = grid_l2_sensitivity(clip, scale, dim)
    assert actual <= bound
    assert actual > 2 * clip * scale + 0.99 * math.sqrt(dim)


def test_grid_sensitivity_bounds_random_clipped_pairs() -> None:
    rng = np.random.default_rng(3)
    dim, scale, clip = 50, 2.0**20, 0.7
    bound = grid_l2_sensitivity(clip, scale, dim)
    for _ in range(200):
        a, b = rng.standard_normal((2, dim)) * rng.exponential(1.0, (2, 1))
        a *= clip * (1 - 1e-12) / max(clip, float(np.linalg.norm(a)))
        b *= clip * (1 - 1e-12) / max(clip, float(np.linalg.norm(b)))
        diff = (_encode(a, scale) - _encode(b, scale)).astype(np.float64)
        assert np.linalg.norm(diff) <= bound


@pytest.mark.parametrize("args", [(-1.0, 2.0, 3), (1.0, 0.0, 3), (1.0, math.inf, 3), (1.0, 2.0, 0)])
def test_grid_sensitivity_refuses_bad_arguments(args: tuple[float, float, int]) -> None:
    with pytest.raises(ValueError):
        grid_l2_sensitivity(*args)


# --- charging zCDP as a Gaussian in Opacus -------------------------------------------


def test_equivalent_noise_multiplier_value() -> None:
    assert equivalent_noise_multiplier(0.125) == 2.0
    assert equivalent_noise_multiplier(2.0) == 0.5


@pytest.mark.parametrize("rho", [1e-4, 0.01, 0.3, 2.0])
def test_the_unsampled_gaussian_rdp_curve_is_alpha_times_rho(rho: float) -> None:
    orders = np.array(RDPAccountant.DEFAULT_ALPHAS, dtype=np.float64)
    z = equivalent_noise_multiplier(rho)
    rdp = compute_rdp(q=1.0, noise_multiplier=z, steps=7, orders=orders)
    np.testing.assert_allclose(rdp, orders * 7 * rho, rtol=1e-12)


@pytest.mark.parametrize(("rho", "steps"), [(0.01, 10), (0.002, 100), (0.5, 3)])
def test_opacus_gives_the_epsilon_of_composed_zcdp(rho: float, steps: int) -> None:
    orders = np.array(RDPAccountant.DEFAULT_ALPHAS, dtype=np.float64)
    accountant = RDPAccountant()
    accountant.history = [(equivalent_noise_multiplier(rho), 1.0, steps)]
    composed, _ = get_privacy_spent(orders=orders, rdp=orders * steps * rho, delta=1e-5)
    assert accountant.get_epsilon(delta=1e-5) == pytest.approx(composed, rel=1e-12)


def test_the_participants_budget_charges_it_through_twice_the_multiplier(tmp_path: Path) -> None:
    """PrivacyBudget.charge halves its argument (sensitivity 2C); ρ already includes the
    sensitivity, so the DDG release is charged as charge(2·z_eff)."""
    rho = ddg_sum_rho(grid_l2_sensitivity(1.0, 2.0**32, 1000), 2.0**32 * 1.3, 8, 1000)
    budget = PrivacyBudget(tmp_path, "ddg", epsilon=1e6, delta=1e-5)
    for _ in range(5):
        spent = budget.charge(2 * equivalent_noise_multiplier(rho))
    orders = np.array(RDPAccountant.DEFAULT_ALPHAS, dtype=np.float64)
    composed, _ = get_privacy_spent(orders=orders, rdp=orders * 5 * rho, delta=1e-5)
    assert spent == pytest.approx(composed, rel=1e-12)


@pytest.mark.parametrize("rho", [0.0, -1.0, math.nan, math.inf])
def test_equivalent_noise_multiplier_refuses_bad_rho(rho: float) -> None:
    with pytest.raises(ValueError):
        equivalent_noise_multiplier(rho)


def test_every_public_name_has_a_docstring() -> None:
    assert inspect.getdoc(dg)
    public = [getattr(dg, name) for name in dir(dg) if not name.startswith("_")]
    functions = [obj for obj in public if inspect.isfunction(obj) and obj.__module__ == dg.__name__]
    assert len(functions) == 5
    for obj in functions:
        assert inspect.getdoc(obj), obj.__name__
