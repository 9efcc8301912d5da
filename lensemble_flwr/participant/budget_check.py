"""Before a participant trains: would its release still fit its privacy budget?

The noise stage charges the budget after training, as the release is made. A budget that
earlier runs (or earlier rounds) have spent is found here first, before the inner loop
runs: the participant refuses the round at once, saying where its budget lives, what is
spent and left, and what its release would need. The charge itself stays the binding
check (another process of the node may spend between this look and the release).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from lensemble_flwr.config import LensembleConfig, default_state_dir
from lensemble_flwr.errors import LensembleError, PrivacyBudgetExceeded
from lensemble_flwr.participant.release_chain import budget_name
from lensemble_flwr.privacy.budget import PrivacyBudget
from lensemble_flwr.privacy.calibration import noise_multiplier_of, planned_epsilon, releases_of
from lensemble_flwr.privacy.distributed import distributed_noise_for
from lensemble_flwr.privacy.plan import shared_dim


def check_budget_affords_release(
    config: LensembleConfig, budget_key: str, params: Mapping[str, np.ndarray]
) -> None:
    """Refuse, before training, a release its budget cannot pay for (nothing is charged).

    ``params``: the global state the round trains from (a distributed share is sized by
    its shared dimension).

    Raises:
        PrivacyBudgetExceeded: the next release would spend more than ``dp-epsilon``; the
            message names the budget file, the epsilon spent, left and needed.
        PrivacyBudgetUnreadable: the budget file cannot be read.
        ConfigError: the file was kept under another accountant or adjacency.
    """
    privacy = config.privacy
    if not privacy.noised:
        return
    directory = privacy.dp_state_dir or str(default_state_dir())
    budget = PrivacyBudget(
        directory,
        budget_name(budget_key),
        epsilon=privacy.dp_epsilon,
        delta=privacy.dp_delta,
        accountant=privacy.dp_accountant,
        adjacency=privacy.dp_adjacency,
    )
    noise = noise_multiplier_of(config)
    factor = None
    if privacy.distributed:  # charged as the equivalent Gaussian of its threshold's shares
        share = distributed_noise_for(
            noise,
            privacy.clip_norm,
            config.aggregation.fraction_bits,
            config.federation.secagg_threshold,
            max(shared_dim(params, config), 1),
            privacy.dp_adjacency,
        )
        noise, factor = share.equivalent_noise_multiplier, 1.0
    after = budget.would_spend(noise, sensitivity_factor=factor)
    if after <= privacy.dp_epsilon:
        return
    spent = budget.spent()
    plan = ""
    if privacy.dp_rounds:
        releases = releases_of(config, privacy.dp_rounds)
        needs = planned_epsilon(
            noise, releases, privacy.dp_delta, privacy.dp_accountant,
            sensitivity=factor or budget.sensitivity_factor,
        )  # fmt: skip
        plan = f"; the run's plan of {privacy.dp_rounds} rounds needs epsilon {needs:.4g}"
    left = max(privacy.dp_epsilon - spent, 0.0)
    raise PrivacyBudgetExceeded(
        f"privacy budget {budget.path} (in dp-budget-dir {directory}; a Flower node's is "
        f"its node config dp-budget-dir, else $LENSEMBLE_PRIVACY_DIR, else the default "
        f"folder): epsilon {spent:.4g} of {privacy.dp_epsilon:g} "
        f"spent by earlier releases ({budget.releases()}), {left:.4g} "
        f"left; one more release would bring it to {after:.4g}{plan}: refused before "
        "training, nothing released"
    )


def budget_refusal(
    config: LensembleConfig, budget_key: str | None, params: Mapping[str, np.ndarray]
) -> LensembleError | None:
    """What :func:`check_budget_affords_release` raises, as a value (None: it fits, or
    ``budget_key`` is None: a custom release chain keeps its budget its own way)."""
    if budget_key is None:
        return None
    try:
        check_budget_affords_release(config, budget_key, params)
    except LensembleError as exc:
        return exc
    return None
