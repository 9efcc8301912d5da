"""The participant registry in the run's store: commitments, membership, mask-key shares.

It is written whenever it changed, before anything that depends on it can reach the
ledger: before a round's sum is revealed, and before a dropped member's mask key is
requested. Every write goes through :class:`~lensemble_flwr.artifacts.store.Store`, so a
crash leaves either the previous version or the new one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import canonical_json
from lensemble_flwr.errors import LedgerError
from lensemble_flwr.protocol.messages import Commitment
from lensemble_flwr.secagg.membership import Membership

REGISTRY = "coordinator/participants"
SHARES = "coordinator/shares"


class _Registry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    commitments: dict[str, dict[str, Any]]
    membership: dict[str, Any]


def save_registry(
    store: Store, commitments: Mapping[str, Commitment], membership: Membership
) -> None:
    """Replace the stored participant registry with the current one (atomically)."""
    registry = _Registry(
        commitments={p: c.model_dump(mode="json") for p, c in sorted(commitments.items())},
        membership=membership.snapshot(),
    )
    store.bind(REGISTRY, store.put(canonical_json(registry.model_dump(mode="json"))))


def save_shares(store: Store, pid: str, membership: Membership) -> None:
    """Keep ``pid``'s stored mask-key shares under a name of its own: a masked round's
    first update of each member costs one small write, not a rewrite of everyone's."""
    entry = {"pid": pid, **membership.shares_snapshot(pid)}
    store.bind(_shares_name(pid), store.put(canonical_json(entry)))


def _shares_name(pid: str) -> str:
    # participant ids are free text; store names are not
    return f"{SHARES}/{hashlib.sha256(pid.encode()).hexdigest()}"


def load_registry(store: Store) -> tuple[dict[str, Commitment], Membership]:
    """The stored registry and mask-key shares; empty when the run never bound anyone.

    Raises:
        LedgerError: the stored registry or a stored share set does not parse.
    """
    try:
        shares = {}
        for name in store.bound(SHARES):
            entry = json.loads(store.get(store.resolve(name)))
            shares[str(entry.pop("pid"))] = entry
        if not store.bound(REGISTRY):
            return {}, Membership.restore({"compromised": []}, shares)
        registry = _Registry.model_validate_json(store.get(store.resolve(REGISTRY)))
        commitments = {p: Commitment.model_validate(c) for p, c in registry.commitments.items()}
        membership = Membership.restore(registry.membership, shares)
    except (ValidationError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise LedgerError(f"participant registry does not parse: {exc}") from None
    return commitments, membership
