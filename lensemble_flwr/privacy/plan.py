"""The privacy plan of a run, said before round 1, with a forecast of what noise does to
the model.

A DP run's settings decide, before anything trains, how much noise the averaged update
carries. :func:`privacy_plan` gathers them (mechanism, noise multiplier σ, clip norm C,
ε target and δ, planned rounds, accountant, adjacency) and forecasts the expected L2 norm
of the noise in the mean update against the clip norm C, the largest the mean's signal can
be (every clipped update has norm at most C). For P shared parameters and N contributors
in a round:

* **local DP** (each release carries N(0, σ²C²) per coordinate; see
  ``release/noise.py``): the uniform mean of N releases carries noise of expected norm
  σ·C·√P/√N, so the ratio is σ·√P/√N. Weighting by example counts w_i (Σ w_i = 1)
  gives σ·C·√P·√(Σ w_i²), which is never less (the forecast is then a lower bound);
* **distributed DP** (each member adds a discrete Gaussian share, sized so that the sum of
  t = ``secagg-threshold`` shares carries std σ·C per coordinate,
  ``privacy/distributed.py``): a sum of N members carries std σ·C·√(N/t), and the mean
  σ·C·√P·√(N/t)/N: the ratio is σ·√P/√(N·t).

A ratio above :data:`LEARNS_BELOW` is the measured point past which the digits app stops
learning (``benchmarks/bench_dp_outer.py``, docs/privacy.md); :meth:`PrivacyPlan.warning`
says so, with what would bring it under.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from lensemble_flwr.config import DP_OUTER_STEP, LensembleConfig
from lensemble_flwr.params import is_shared
from lensemble_flwr.privacy.budget import sensitivity_factor
from lensemble_flwr.privacy.calibration import noise_multiplier_of, planned_epsilon, releases_of

LEARNS_BELOW = 4.0
"""The noise-to-signal ratio (expected L2 norm of the noise on the mean update over the
clip norm) above which the forecast warns that the model cannot learn. Measured on the
digits app (10 nodes, ``DigitsNet``, ``benchmarks/bench_dp_outer.py``): at a ratio of 4
every outer step tried beat chance (0.1) by at least 0.4 within 10 rounds; at 8, two of
the four fell short of chance + 0.2 in 6 rounds, and at 16 all did (docs/privacy.md,
*The privacy plan*)."""


@dataclasses.dataclass(frozen=True)
class PrivacyPlan:
    """A noised run's plan and its forecast (see the module).

    Attributes:
        mode: ``"local"`` or ``"distributed"``.
        noise_multiplier: σ, the noise std on a release (local) or on the sum of
            ``threshold`` shares (distributed), in units of the clip norm.
        clip_norm: C.
        epsilon: the ε each participant's budget is asked for (``dp-epsilon``).
        delta: δ.
        rounds: the rounds the budget is planned for (``dp-rounds``, else the run's).
        releases: the releases per participant the plan pays for (fewer under sampling).
        accountant: ``"rdp"`` or ``"prv"``.
        adjacency: ``"substitution"`` or ``"zero-out"``.
        participants: N, the contributors a round is forecast to have.
        threshold: t, the fewest shares a distributed sum carries (0 under local DP).
        dim: P, the shared parameters a release carries.
        weighting: ``uniform`` or ``num-examples``.
        outer_lr, outer_momentum: the run's outer step.
    """

    mode: str
    noise_multiplier: float
    clip_norm: float
    epsilon: float
    delta: float
    rounds: int
    releases: int
    accountant: str
    adjacency: str
    participants: int
    threshold: int
    dim: int
    weighting: str
    outer_lr: float = DP_OUTER_STEP["lr"]
    outer_momentum: float = DP_OUTER_STEP["momentum"]

    @property
    def noise_to_signal(self) -> float:
        """The expected L2 norm of the noise on the mean update over the clip norm."""
        n, p = max(self.participants, 1), self.dim
        if self.mode == "distributed":
            return self.noise_multiplier * math.sqrt(p / (n * max(self.threshold, 1)))
        return self.noise_multiplier * math.sqrt(p / n)

    @property
    def learns(self) -> bool:
        """Whether the forecast is under :data:`LEARNS_BELOW`."""
        return self.noise_to_signal <= LEARNS_BELOW

    def lines(self) -> list[str]:
        """The plan, a line each, as the run's log says it."""
        mechanism = (
            f"distributed discrete Gaussian over masked sums of at least {self.threshold}"
            if self.mode == "distributed"
            else "local Gaussian (each release carries the whole noise)"
        )
        formula = (
            "sigma*sqrt(P/(N*t))" if self.mode == "distributed" else "sigma*sqrt(P/N)"
        )
        bound = " (at least: num-examples weighting adds to it)" if (
            self.mode == "local" and self.weighting == "num-examples"
        ) else ""
        dp_step = (DP_OUTER_STEP["lr"], DP_OUTER_STEP["momentum"])
        outer = (
            "the default under DP, measured on the digits app"
            if (self.outer_lr, self.outer_momentum) == dp_step
            else f"as set; the default under DP is lr {dp_step[0]:g}, momentum {dp_step[1]:g}"
        )
        planned = (
            f"{self.rounds} rounds"
            if self.releases == self.rounds
            else f"{self.rounds} rounds ({self.releases} releases under sampling)"
        )
        return [
            f"privacy plan: {mechanism}",
            f"noise multiplier {self.noise_multiplier:.4g}, clip norm {self.clip_norm:g}, "
            f"epsilon {self.epsilon:g} at delta {self.delta:g} over {planned}, "
            f"accountant {self.accountant}, {self.adjacency} adjacency",
            f"forecast: noise on the mean update {self.noise_to_signal:.3g} x the clip norm"
            f"{bound} = {formula}, N = {self.participants} contributors, P = {self.dim} "
            f"shared parameters; the model learns below about {LEARNS_BELOW:g}",
            f"outer step: lr {self.outer_lr:g}, momentum {self.outer_momentum:g} ({outer})",
        ]

    def _epsilon_for(self, shrink: float) -> str:
        """What the plan's rounds would spend at ``1/shrink`` of its noise (Gaussian
        accounting; a distributed sum's is close)."""
        sigma = self.noise_multiplier / shrink
        factor = sensitivity_factor(self.adjacency)
        spent = planned_epsilon(sigma, self.releases, self.delta, "rdp", sensitivity=factor)
        return f"epsilon about {spent:.3g} over {self.rounds} rounds"

    def warning(self) -> str | None:
        """None when the forecast learns; else why it cannot, and what would fix it."""
        ratio = self.noise_to_signal
        if ratio <= LEARNS_BELOW:
            return None
        shrink = ratio / LEARNS_BELOW
        fixes = []
        if self.mode == "local":
            fixes.append(
                'distributed DP (dp-mode = "distributed" with secagg-threshold t: the noise '
                "on the mean falls by sqrt(t), here to "
                f"{ratio / math.sqrt(self.participants):.3g} with t = N = {self.participants})"
            )
            fixes.append(f"more participants (about {math.ceil(self.participants * shrink**2)})")
        else:
            fixes.append(
                f"more participants (about {math.ceil(self.participants * shrink)}, with "
                "secagg-threshold raised in proportion)"
            )
        smaller = int(self.dim / shrink**2)
        if smaller >= 100:
            fixes.append(f"a smaller model (at most about {smaller} shared parameters)")
        fixes.append(
            f"fewer rounds or a larger epsilon (noise multiplier at most about "
            f"{self.noise_multiplier / shrink:.3g}: {self._epsilon_for(shrink)})"
        )
        return (
            f"the privacy plan's noise on the mean update is {ratio:.3g} x the clip norm, "
            f"above {LEARNS_BELOW:g}: the model is not expected to learn. What would fix "
            "it: " + "; ".join(fixes)
        )


def shared_dim(params: Mapping[str, np.ndarray], config: LensembleConfig) -> int:
    """P: how many values a release carries (the shared groups' floating-point arrays)."""
    return int(
        sum(
            np.asarray(a).size
            for name, a in params.items()
            if is_shared(name, config.groups) and np.issubdtype(np.asarray(a).dtype, np.floating)
        )
    )


def privacy_plan(
    config: LensembleConfig, *, rounds: int, participants: int, dim: int
) -> PrivacyPlan | None:
    """The plan of a run of ``rounds`` rounds with ``participants`` contributors a round
    over ``dim`` shared parameters (None: no noise).

    Raises:
        ConfigError: a plan the budget cannot cover (as ``noise_multiplier_of``).
    """
    privacy, fed = config.privacy, config.federation
    if not privacy.noised:
        return None
    planned = privacy.dp_rounds or rounds
    return PrivacyPlan(
        mode=privacy.dp_mode,
        noise_multiplier=noise_multiplier_of(config, rounds=rounds),
        clip_norm=privacy.clip_norm,
        epsilon=privacy.dp_epsilon,
        delta=privacy.dp_delta,
        rounds=planned,
        releases=releases_of(config, planned),
        accountant=privacy.dp_accountant,
        adjacency=privacy.dp_adjacency,
        participants=max(participants, 1),
        threshold=fed.secagg_threshold if privacy.distributed else 0,
        dim=dim,
        weighting=fed.weighting,
        outer_lr=config.outer.lr,
        outer_momentum=config.outer.momentum,
    )
