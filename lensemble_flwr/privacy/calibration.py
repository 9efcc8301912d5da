"""Noise from a target: the noise multiplier that spends a budget over the planned rounds.

A participant's releases are accounted as in :mod:`.budget`: each is a Gaussian mechanism
with sensitivity 2C (substitution of the participant's dataset; C under ``dp-adjacency =
"zero-out"``) and no sampling amplification, so R releases at noise multiplier σ cost
what R steps of a Gaussian with multiplier σ/2 (σ under zero-out) at sample rate 1 cost
in Opacus's accountant. This module answers the three questions a plan asks, with that
same accountant:

* how much a plan spends (:func:`planned_epsilon`);
* the smallest σ whose plan fits a budget (:func:`calibrated_noise_multiplier`, Opacus's
  ``get_noise_multiplier``);
* how many rounds a σ affords (:func:`max_rounds`).

A plan counts *releases*, not rounds. Without sampling a participant releases once a round,
so R rounds plan R releases. With ``sample-fraction`` q < 1 a participant is asked in a
round with probability q, independently across rounds (Poisson sampling exactly; a fixed
sample of ⌊Nq⌋ of N nearly so), so over R rounds it releases Binomial(R, q) times: the
plan is the smallest k with P(Binomial(R, q) > k) <= ``dp-overrun``
(:func:`planned_releases`). A participant asked more often than k refuses the extra
releases: its budget, charged before every release, holds whatever the draw. The
epsilon figures claim no amplification by sampling (the coordinator knows the sample);
sampling only means fewer releases to pay for, hence less noise on each.

:func:`noise_multiplier_of` is what the release chain and the coordinator use: the
explicit ``noise-multiplier``, or, with ``noise-multiplier = 0`` and ``dp-rounds`` set,
the calibrated one; a plan the budget cannot cover is a ``ConfigError`` before any round,
saying the smallest noise and the most releases that would fit.
"""

from __future__ import annotations

import functools
import math

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.privacy.budget import (
    SENSITIVITY_FACTOR,
    Mechanism,
    accountant_class,
    import_opacus,
    sensitivity_factor,
)

_MAX_ROUNDS = 10**7
"""The largest plan :func:`max_rounds` searches (a bound for the bisection)."""


@functools.lru_cache(maxsize=256)
def planned_releases(rounds: int, sample_rate: float = 1.0, overrun: float = 0.01) -> int:
    """How many releases a participant's budget must pay for over ``rounds`` rounds when
    each round asks it with probability ``sample_rate``: the smallest k with
    P(Binomial(rounds, sample_rate) > k) <= ``overrun`` (``rounds`` itself at rate 1).

    Raises:
        ValueError: a negative plan, a rate outside (0, 1] or an overrun outside (0, 1).
    """
    if rounds < 0 or not 0 < sample_rate <= 1 or not 0 < overrun < 1:
        raise ValueError(
            f"planned_releases needs rounds >= 0, 0 < sample_rate <= 1 and 0 < overrun < 1, "
            f"not {rounds}, {sample_rate}, {overrun}"
        )
    if sample_rate == 1 or rounds == 0:
        return rounds
    log_q, log_p = math.log(sample_rate), math.log1p(-sample_rate)

    def log_pmf(j: int) -> float:
        log_comb = math.lgamma(rounds + 1) - math.lgamma(j + 1) - math.lgamma(rounds - j + 1)
        return log_comb + j * log_q + (rounds - j) * log_p

    # P(X > k), summed from the top down: small tails are added to small tails, never
    # taken as 1 - P(X <= k), which would lose them to cancellation
    tail = 0.0
    for k in range(rounds - 1, -1, -1):
        tail += math.exp(log_pmf(k + 1))
        if tail > overrun:
            return k + 1
    return 0


def releases_of(config: LensembleConfig, rounds: int) -> int:
    """The releases ``rounds`` rounds of ``config``'s federation plan for one participant
    (:func:`planned_releases` at its ``sample-fraction`` and ``dp-overrun``)."""
    fed = config.federation
    rate = fed.sample_fraction if fed.sampled else 1.0
    releases = planned_releases(rounds, rate, config.privacy.dp_overrun)
    return max(releases, 1) if rounds > 0 else 0  # a plan pays for one release at least


@functools.lru_cache(maxsize=256)
def planned_epsilon(
    noise_multiplier: float,
    rounds: int,
    delta: float,
    accountant: Mechanism = "rdp",
    *,
    sensitivity: float = SENSITIVITY_FACTOR,
) -> float:
    """The epsilon (at ``delta``) that ``rounds`` releases at ``noise_multiplier`` spend,
    each of L2 sensitivity ``sensitivity`` clip norms (:data:`.budget.SENSITIVITY_FACTORS`)."""
    if rounds <= 0:
        return 0.0
    if not noise_multiplier > 0:
        return math.inf
    account = accountant_class(accountant)()
    account.history = [(noise_multiplier / sensitivity, 1.0, rounds)]
    return float(account.get_epsilon(delta=delta))


@functools.lru_cache(maxsize=64)
def calibrated_noise_multiplier(
    epsilon: float,
    delta: float,
    rounds: int,
    accountant: Mechanism = "rdp",
    *,
    sensitivity: float = SENSITIVITY_FACTOR,
) -> float:
    """The smallest noise multiplier (within Opacus's 0.01 tolerance on epsilon) whose
    ``rounds`` releases, each of sensitivity ``sensitivity`` clip norms, spend at most
    ``epsilon`` at ``delta``.

    Raises:
        ConfigError: no noise multiplier Opacus searches reaches the target.
    """
    get_noise_multiplier = import_opacus("opacus.accountants.utils").get_noise_multiplier

    try:
        z = get_noise_multiplier(
            target_epsilon=epsilon,
            target_delta=delta,
            sample_rate=1.0,
            steps=rounds,
            accountant=accountant,
            epsilon_tolerance=0.01,
        )
    except ValueError as exc:
        raise ConfigError(
            "dp-epsilon",
            f"no noise multiplier spends at most epsilon {epsilon:g} over {rounds} rounds "
            f"(delta {delta:g}): {exc}",
        ) from None
    sigma = sensitivity * float(z)
    # Opacus returns the upper end of its bisection; the plan must fit, checked here
    if planned_epsilon(sigma, rounds, delta, accountant, sensitivity=sensitivity) > epsilon:
        raise ConfigError("dp-epsilon", f"calibration gave sigma {sigma:g}, which overspends")
    return sigma


def max_rounds(
    noise_multiplier: float,
    epsilon: float,
    delta: float,
    accountant: Mechanism = "rdp",
    *,
    sensitivity: float = SENSITIVITY_FACTOR,
) -> int:
    """The most releases at ``noise_multiplier`` that fit ``epsilon`` (0: not even one)."""

    def spends(releases: int) -> float:
        return planned_epsilon(
            noise_multiplier, releases, delta, accountant, sensitivity=sensitivity
        )

    if spends(1) > epsilon:
        return 0
    low, high = 1, 2
    while high < _MAX_ROUNDS and spends(high) <= epsilon:
        low, high = high, high * 2
    if high >= _MAX_ROUNDS:
        return _MAX_ROUNDS
    while high - low > 1:  # fits at low, not at high
        mid = (low + high) // 2
        if spends(mid) <= epsilon:
            low = mid
        else:
            high = mid
    return low


def check_plan(config: LensembleConfig, noise_multiplier: float, rounds: int) -> None:
    """Refuse a plan of ``rounds`` rounds at ``noise_multiplier`` whose releases
    (:func:`releases_of`) the budget cannot cover, before any of them.

    Raises:
        ConfigError: naming the plan's epsilon, the smallest noise multiplier that would fit
            and the most releases the given one affords.
    """
    if not noise_multiplier > 0 or rounds <= 0:
        return
    privacy = config.privacy
    eps, delta, mech = privacy.dp_epsilon, privacy.dp_delta, privacy.dp_accountant
    factor = sensitivity_factor(privacy.dp_adjacency)
    releases = releases_of(config, rounds)
    spent = planned_epsilon(noise_multiplier, releases, delta, mech, sensitivity=factor)
    if spent <= eps:
        return
    needed = calibrated_noise_multiplier(eps, delta, releases, mech, sensitivity=factor)
    affords = max_rounds(noise_multiplier, eps, delta, mech, sensitivity=factor)
    adjacency = "" if privacy.dp_adjacency == "substitution" else ", zero-out adjacency"
    unit = "rounds" if releases == rounds else "releases"
    plan = (
        f"{rounds} rounds"
        if releases == rounds
        else (
            f"{releases} releases ({rounds} rounds at sample-fraction "
            f"{config.federation.sample_fraction:g}, dp-overrun {privacy.dp_overrun:g})"
        )
    )
    raise ConfigError(
        "noise-multiplier",
        f"{plan} at noise-multiplier {noise_multiplier:g} would spend epsilon "
        f"{spent:.4g} > dp-epsilon {eps:g} (delta {delta:g}, {mech}{adjacency}): use "
        f"noise-multiplier >= {needed:.4g}, or plan at most {affords} {unit}, or set "
        "noise-multiplier = 0 with dp-rounds to calibrate the noise to the budget",
    )


def noise_multiplier_of(config: LensembleConfig, rounds: int | None = None) -> float:
    """The noise multiplier every release of ``config``'s federation uses (0: none).

    The explicit ``noise-multiplier`` if set, else, with ``dp-rounds``, the one
    calibrated to spend ``dp-epsilon`` over the releases they plan (:func:`releases_of`:
    every round, or under sampling the releases a participant is likely asked for). The
    plan checked is ``dp-rounds``, or ``rounds`` (the run's) when ``dp-rounds`` is 0.

    Raises:
        ConfigError: the plan exceeds the budget, or the run plans more rounds than
            ``dp-rounds`` (before any round: nothing is released).
    """
    privacy = config.privacy
    planned = privacy.dp_rounds or (rounds or 0)
    if privacy.dp_rounds and rounds is not None and rounds > privacy.dp_rounds:
        raise ConfigError(
            "dp-rounds",
            f"the run plans {rounds} rounds but the noise is planned for dp-rounds "
            f"{privacy.dp_rounds}: raise dp-rounds (more noise) or run fewer rounds",
        )
    if privacy.noise_multiplier > 0:
        check_plan(config, privacy.noise_multiplier, planned)
        return privacy.noise_multiplier
    if privacy.calibrated:
        return calibrated_noise_multiplier(
            privacy.dp_epsilon,
            privacy.dp_delta,
            releases_of(config, privacy.dp_rounds),
            privacy.dp_accountant,
            sensitivity=sensitivity_factor(privacy.dp_adjacency),
        )
    return 0.0


NOISE_REACH = 10.0
"""How many noise standard deviations past the clip norm a local-DP release's values may
reach at ingress (a Gaussian coordinate is beyond 10σ with probability ~1.5e-23)."""


def ingress_bound(config: LensembleConfig) -> float:
    """The largest |value| an update may carry: ``max-abs-update`` (when unset, 0:
    max(64, clip norm) for clipped, noised or masked releases, else as large as the exact
    sum allows: :meth:`~lensemble_flwr.config.AggregationConfig.plaintext_bound`), raised
    under local DP to what a noised release reaches (clip norm plus ``NOISE_REACH`` noise
    std), so that calibrated noise at a small epsilon does not get every release rejected.

    Raises:
        ConfigError: that bound does not fit the int64 accumulator at the run's largest
            weight (1 under uniform weighting, else ``max-weight``) and ``fraction-bits``.
    """
    agg, privacy = config.aggregation, config.privacy
    # unset: the guard's 64 (or the clip norm) for clipped, noised or masked releases; for
    # unprotected ones (a stock ClientApp's, as FedAvg takes any) the exact sum's room
    protected = privacy.clip_norm > 0 or privacy.noised or config.federation.masked
    largest = config.largest_weight
    bound = (
        agg.guarded_bound(privacy.clip_norm)
        if protected
        else agg.plaintext_bound(largest_weight=largest)
    )
    if privacy.noised and not privacy.distributed:
        reach = privacy.clip_norm * (1.0 + NOISE_REACH * noise_multiplier_of(config))
        bound = max(bound, reach)
    if bound * largest * 2.0**agg.fraction_bits >= 2.0**62:
        raise ConfigError(
            "max-abs-update",
            f"updates may reach |value| {bound:.4g}, which does not fit the int64 "
            f"accumulator at a weight of {largest} and fraction-bits "
            f"{agg.fraction_bits}: lower max-weight or fraction-bits (or the noise, or "
            "the clip norm)",
        )
    return bound


def with_ingress_bound(config: LensembleConfig) -> LensembleConfig:
    """``config`` whose ``max-abs-update`` is :func:`ingress_bound` (what the aggregators
    and a masked member check against)."""
    bound = ingress_bound(config)
    if bound == config.aggregation.max_abs_update:
        return config
    aggregation = config.aggregation.model_copy(update={"max_abs_update": bound})
    return config.model_copy(update={"aggregation": aggregation})
