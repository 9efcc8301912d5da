"""A Flower node's own privacy settings: its SuperNode's node config, not the run's.

The SuperNode's operator holds the data, so it sets the budget::

    flower-supernode ... --node-config "lensemble-id='hospital-a' dp-epsilon-cap=8.0
        dp-delta=1e-5 dp-accountant='rdp' dp-budget-dir='/var/lib/lensemble/privacy'"

Every key is optional; an unset one takes the owner's default
(:class:`~lensemble_flwr.privacy.ownership.BudgetOwner`). A run's ``lensemble.dp-*``
settings are checked against these (:func:`~lensemble_flwr.privacy.ownership.owned_config`)
before the participant is built.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from flwr.app import Context

from lensemble_flwr.errors import ConfigError
from lensemble_flwr.privacy.ownership import OWNER_KEYS, BudgetOwner

_FIELDS = {key: field for field, key in OWNER_KEYS.items()}
_TYPES: dict[str, tuple[type, ...]] = {
    "epsilon_cap": (int, float),
    "delta": (int, float),
    "accountant": (str,),
    "budget_dir": (str,),
}


def owner_from_node_config(node_config: Mapping[str, Any]) -> BudgetOwner:
    """The budget settings a node config gives (defaults for the keys it leaves out).

    Raises:
        ConfigError: a ``dp-`` key that is not one of the owner's (a typo would silently
            leave the default in force), a value of the wrong type, or one
            :class:`BudgetOwner` refuses; the error names the node config key.
    """
    settings: dict[str, Any] = {}
    for key, value in node_config.items():
        if not key.startswith("dp-"):
            continue
        if key not in _FIELDS:
            close = difflib.get_close_matches(key, list(_FIELDS), n=1)
            hint = f": did you mean {close[0]!r}?" if close else f": one of {sorted(_FIELDS)}"
            raise ConfigError(f"node config {key}", f"not a node privacy key{hint}")
        field = _FIELDS[key]
        if isinstance(value, bool) or not isinstance(value, _TYPES[field]):
            wanted = "a number" if float in _TYPES[field] else "text"
            raise ConfigError(f"node config {key}", f"{value!r} is not {wanted}")
        settings[field] = float(value) if field in ("epsilon_cap", "delta") else value
    return BudgetOwner(**settings, source="node config")


def bounded_by_node_config(owner: BudgetOwner, node_config: Mapping[str, Any]) -> BudgetOwner:
    """``owner`` (settings an app's ``node_privacy_fn`` chose) within what the SuperNode's
    node config sets: the smaller of the two caps, and the node config's delta,
    accountant and budget directory wherever it sets them. The app comes with the run;
    the node config is the operator's, so an app cannot raise what the operator set.

    Raises:
        ConfigError: see :func:`owner_from_node_config`.
    """
    node = owner_from_node_config(node_config)
    given = {_FIELDS[key] for key in node_config if key in _FIELDS}
    if not given:
        return owner
    return dataclasses.replace(
        owner,
        epsilon_cap=min(owner.epsilon_cap, node.epsilon_cap),
        delta=node.delta if "delta" in given else owner.delta,
        accountant=node.accountant if "accountant" in given else owner.accountant,
        budget_dir=node.budget_dir if "budget_dir" in given else owner.budget_dir,
    )


def node_privacy(context: Context) -> BudgetOwner:
    """This node's budget settings: its SuperNode's node config
    (:func:`owner_from_node_config`)."""
    return owner_from_node_config(context.node_config)
