"""Which reachable participants a sampled attempt invites: pure functions of their values.

When rounds are sampled (``sample-fraction`` < 1), each attempt draws its sample once,
from a seed of the run, the round and the attempt, as soon as at least ``min-available``
(and the quorum) participants are reachable; none is invited before. A fixed-size sample
ranks every reachable participant by a SHA-256 of that seed and its id and takes the
first ``sample_size``; a Poisson sample keeps each with probability ``sample-fraction``,
redrawn (from seeds derived from the same one) while it is shorter than the quorum.
Nothing here reads a clock, a transport or the attempt: the caller records the draw.
"""

from __future__ import annotations

from collections.abc import Set

from lensemble_flwr.canonical import derive_seed, poisson_sample, seeded_sample
from lensemble_flwr.config import FederationConfig, PrivacyConfig

POISSON_DRAWS = 100
"""Poisson draws an attempt makes (each from its own seed) before it gives up on K."""


def poisson_draw(reachable: Set[str], rate: float, seed: int, quorum: int) -> list[str]:
    """The first of up to :data:`POISSON_DRAWS` Poisson samples of ``reachable`` (seeds
    derived from ``seed`` and the draw's number) with at least ``quorum`` participants: a
    short draw could only abort the attempt after its members trained and spent budget.
    The last draw if none is long enough."""
    drawn: list[str] = []
    for draw in range(POISSON_DRAWS):
        drawn = poisson_sample(reachable, rate, derive_seed(seed, "draw", draw), "sample")
        if len(drawn) >= quorum:
            break
    return drawn


def draw_sample(
    reachable: frozenset[str], round: int, attempt: int, federation: FederationConfig
) -> frozenset[str] | None:
    """The sample of attempt ``attempt`` of round ``round`` among ``reachable``; None while
    fewer than ``min-available`` (or the quorum) are reachable: a sample below K could
    only abort, so the attempt waits for more peers before it draws."""
    if len(reachable) < max(federation.min_available, federation.quorum, 1):
        return None
    seed = derive_seed(federation.root_seed, "sample", round, attempt)
    if federation.sample_mode == "poisson":
        drawn = poisson_draw(reachable, federation.sample_fraction, seed, federation.quorum)
    else:
        drawn = seeded_sample(reachable, federation.sample_size(len(reachable)), seed, "sample")
    return frozenset(drawn)


def oversampled(
    drawn: int, reachable: int, federation: FederationConfig, privacy: PrivacyConfig
) -> bool:
    """Whether a fixed sample of ``drawn`` of ``reachable`` asks more participants than
    ``sample-fraction`` of them (raised to ``sample-min`` or the quorum) while the privacy
    plan counts on that fraction (``privacy.calibration.releases_of``): participants then
    spend their budgets faster than planned."""
    if not privacy.noised or federation.sample_mode != "fixed":
        return False
    return drawn > federation.sample_fraction * reachable + 1
