"""A Flower node's own privacy settings: its SuperNode's node config, not the run's.

The SuperNode's operator holds the data, so it sets the budget::

    flower-supernode ... --node-config "lensemble-id='hospital-a' dp-epsilon-cap=8.0
        dp-delta=1e-5 dp-accountant='rdp' dp-adjacency='substitution'
        dp-release-metrics=false dp-budget-dir='/var/lib/lensemble/privacy'"

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
from lensemble_flwr.privacy.ownership import NODE_CONFIG, OWNER_KEYS, BudgetOwner

_FIELDS = {key: field for field, key in OWNER_KEYS.items()}
_TYPES: dict[str, tuple[type, ...]] = {
    "epsilon_cap": (int, float),
    "delta": (int, float),
    "accountant": (str,),
    "budget_dir": (str,),
    "adjacency": (str,),
    "release_metrics": (bool,),
}
_WANTED = {(int, float): "a number", (str,): "text", (bool,): "true or false"}


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
        wanted = _TYPES[field]
        if isinstance(value, bool) is not (bool in wanted) or not isinstance(value, wanted):
            raise ConfigError(f"node config {key}", f"{value!r} is not {_WANTED[wanted]}")
        settings[field] = float(value) if field in ("epsilon_cap", "delta") else value
    return BudgetOwner(**settings, source=NODE_CONFIG)


def bounded_by_node_config(owner: BudgetOwner, node_config: Mapping[str, Any]) -> BudgetOwner:
    """``owner`` (settings an app's ``node_privacy_fn`` chose) within what the SuperNode's
    node config sets: the smaller of the two caps, metrics released only if both allow
    it, and the node config's delta, accountant, adjacency and budget directory wherever
    it sets them. The app comes with the run; the node config is the operator's, so an
    app cannot raise what the operator set. The fields the node config decided are
    named as the node config's in messages, the others as ``owner.source``'s.

    Raises:
        ConfigError: see :func:`owner_from_node_config`.
    """
    node = owner_from_node_config(node_config)
    given = {_FIELDS[key] for key in node_config if key in _FIELDS}
    if not given:
        return owner
    decided = given - {"epsilon_cap", "release_metrics"}  # the node's value, where it set one
    if "epsilon_cap" in given and node.epsilon_cap <= owner.epsilon_cap:
        decided.add("epsilon_cap")
    if "release_metrics" in given and not node.release_metrics:
        decided.add("release_metrics")
    settings = {field: getattr(node if field in decided else owner, field) for field in OWNER_KEYS}
    return dataclasses.replace(
        owner, **settings, from_node_config=owner.from_node_config | frozenset(decided)
    )


def node_privacy(context: Context) -> BudgetOwner:
    """This node's budget settings: its SuperNode's node config
    (:func:`owner_from_node_config`)."""
    return owner_from_node_config(context.node_config)
