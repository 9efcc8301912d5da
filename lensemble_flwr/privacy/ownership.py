"""Whose privacy budget it is: the data owner's settings, and a run's request checked
against them.

A participant's budget (:class:`~lensemble_flwr.privacy.budget.PrivacyBudget`) protects
its owner's data, so its cap, its delta, its accountant and where its file lives are the
owner's to set, not the run's. On a Flower node the owner speaks through the SuperNode's
node config (:mod:`lensemble_flwr.clients.node_privacy`); a run speaks through its run
config (``lensemble.dp-epsilon`` and friends), which whoever starts the run chooses. A
run's privacy settings are therefore a *request*: :func:`owned_config` lets a run plan
within the owner's settings and refuses, naming both values, a run that asks for a
larger epsilon, another delta or accountant, or another budget directory.

The budget file's cap is the run's epsilon, which is at most the owner's cap, and the
file holds everything spent under the owner's directory and the participant's stable
identity, by every run: a run that asks again for the cap finds what earlier runs spent
already charged, and one that asks for more is refused before it trains.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

from lensemble_flwr.config import Adjacency, LensembleConfig, default_state_dir
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.privacy.budget import MECHANISMS, SENSITIVITY_FACTORS, Mechanism

DEFAULT_EPSILON_CAP = 10.0
"""The cap of an owner that sets none: epsilon 10 over everything it ever releases."""
DEFAULT_DELTA = 1e-5
"""The delta of an owner that sets none (the run config's default ``dp-delta`` too)."""
NODE_CONFIG = "node config"
"""The :attr:`BudgetOwner.source` of settings read from a SuperNode's node config."""
APP_SETTINGS = "the app's node_privacy_fn"
"""The :attr:`BudgetOwner.source` of settings built in code (by default: an app's
``node_privacy_fn``, which comes with the run's app bundle)."""


@dataclass(frozen=True)
class BudgetOwner:
    """The data owner's settings for its privacy budget.

    Attributes:
        epsilon_cap: the most epsilon any run may ask for; the budget file never records
            more, over all runs.
        delta: the delta every epsilon of the budget is at.
        accountant: the accountant the budget is composed with ("rdp" or "prv").
        budget_dir: the directory of the budget files and commitment secrets ('' : the
            default, ``$LENSEMBLE_PRIVACY_DIR`` or ``~/.local/share/lensemble-flwr/privacy``).
        adjacency: what every epsilon of the budget protects ("substitution", the
            default, or "zero-out", which needs half the noise for the same epsilon).
        release_metrics: whether this participant may send per-node train loss and
            evaluation metrics (un-noised) when a run under DP or secure aggregation
            asks for them (default: never).
        source: where the settings were written, for messages: :data:`NODE_CONFIG` (keys
            ``dp-epsilon-cap``, ...) or, by default, :data:`APP_SETTINGS`.
        from_node_config: the fields whose value a node config decided over ``source``'s
            (:func:`~lensemble_flwr.clients.node_privacy.bounded_by_node_config`), so
            that a message names where each value came from.

    Raises:
        ConfigError: a cap that is not a positive finite number, a delta outside (0, 1),
            an unknown accountant or adjacency, naming the owner's key.
    """

    epsilon_cap: float = DEFAULT_EPSILON_CAP
    delta: float = DEFAULT_DELTA
    accountant: Mechanism = "rdp"
    budget_dir: str = ""
    adjacency: Adjacency = "substitution"
    release_metrics: bool = False
    source: str = dataclasses.field(default=APP_SETTINGS, compare=False)  # labels, not settings
    from_node_config: frozenset[str] = dataclasses.field(default=frozenset(), compare=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epsilon_cap) and self.epsilon_cap > 0):
            raise ConfigError(
                self.named("epsilon_cap"), f"{self.epsilon_cap!r} is not a positive finite epsilon"
            )
        if not 0 < self.delta < 1:
            raise ConfigError(self.named("delta"), f"{self.delta!r} is not in (0, 1)")
        if self.accountant not in MECHANISMS:
            raise ConfigError(
                self.named("accountant"),
                f"unknown accountant {self.accountant!r}: one of {list(MECHANISMS)}",
            )
        if self.adjacency not in SENSITIVITY_FACTORS:
            raise ConfigError(
                self.named("adjacency"),
                f"unknown adjacency {self.adjacency!r}: one of {sorted(SENSITIVITY_FACTORS)}",
            )

    @staticmethod
    def key(field: str) -> str:
        """The owner's key for ``field`` (``dp-epsilon-cap`` for ``epsilon_cap``)."""
        return OWNER_KEYS[field]

    def directory(self) -> Path:
        """Where the owner keeps its budgets (the default directory when it names none)."""
        return Path(self.budget_dir) if self.budget_dir else default_state_dir()

    def named(self, field: str) -> str:
        """Where ``field``'s value was set, for messages: "node config dp-delta", or
        "delta from the app's node_privacy_fn" for a value set in code."""
        source = NODE_CONFIG if field in self.from_node_config else self.source
        if source == NODE_CONFIG:
            return f"{NODE_CONFIG} {self.key(field)}"
        return f"{field} from {source}"


OWNER_KEYS: dict[str, str] = {
    "epsilon_cap": "dp-epsilon-cap",
    "delta": "dp-delta",
    "accountant": "dp-accountant",
    "budget_dir": "dp-budget-dir",
    "adjacency": "dp-adjacency",
    "release_metrics": "dp-release-metrics",
}
"""The owner's keys (a SuperNode's ``--node-config``), by :class:`BudgetOwner` field."""


def owned_config(config: LensembleConfig, owner: BudgetOwner) -> LensembleConfig:
    """``config`` (a run's request) with ``owner``'s budget directory, once it fits
    ``owner``'s settings.

    The directory rule holds with or without noise (the directory also keeps the
    commitment secret); the metrics rule wherever the run's per-node metrics would be
    withheld otherwise (under DP or secure aggregation); the others when the run's
    releases are noised.

    Raises:
        ConfigError: the run asks for an epsilon above the owner's cap, another delta,
            accountant or adjacency, another budget directory (a run cannot move the
            budget), or per-node metrics the owner does not release; the message names
            the run's value and the owner's.
    """
    privacy = config.privacy
    home = owner.directory()
    asked = privacy.dp_state_dir
    if asked and _resolved(asked) != _resolved(home):
        raise ConfigError(
            "lensemble.dp-state-dir",
            f"the run asks to keep this participant's budget in {asked}, but its owner "
            f"keeps it in {home} ({owner.named('budget_dir')}; default if unset): a run "
            "cannot move a participant's budget (leave dp-state-dir empty)",
        )
    if privacy.noised:
        if privacy.dp_epsilon > owner.epsilon_cap:
            raise ConfigError(
                "lensemble.dp-epsilon",
                f"the run asks for epsilon {privacy.dp_epsilon:g}, above this participant's "
                f"cap {owner.epsilon_cap:g} ({owner.named('epsilon_cap')}): refused, nothing "
                "released",
            )
        if privacy.dp_delta != owner.delta:
            raise ConfigError(
                "lensemble.dp-delta",
                f"the run asks for delta {privacy.dp_delta:g}, but this participant's budget "
                f"is kept at delta {owner.delta:g} ({owner.named('delta')})",
            )
        if privacy.dp_accountant != owner.accountant:
            raise ConfigError(
                "lensemble.dp-accountant",
                f"the run asks for the {privacy.dp_accountant!r} accountant, but this "
                f"participant's budget is composed with {owner.accountant!r} "
                f"({owner.named('accountant')})",
            )
        if privacy.dp_adjacency != owner.adjacency:
            raise ConfigError(
                "lensemble.dp-adjacency",
                f"the run asks for {privacy.dp_adjacency!r} adjacency, but this "
                f"participant's budget is kept under {owner.adjacency!r} "
                f"({owner.named('adjacency')}): a run cannot change what its epsilon protects",
            )
    private = privacy.noised or config.federation.masked
    if private and privacy.dp_release_metrics and not owner.release_metrics:
        raise ConfigError(
            "lensemble.dp-release-metrics",
            "the run asks for this participant's un-noised train loss and evaluation "
            f"metrics (dp-release-metrics = true), but its owner does not release them "
            f"({owner.named('release_metrics')} is false): refused, nothing released",
        )
    placed = privacy.model_copy(update={"dp_state_dir": str(home)})
    return config.model_copy(update={"privacy": placed})


def _resolved(path: str | os.PathLike[str]) -> Path:
    return Path(path).expanduser().resolve()
