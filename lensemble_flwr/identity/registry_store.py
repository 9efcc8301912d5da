"""The participant registry in the run's store: commitments and unspent mask keys.

It is written whenever it changed, before anything that depends on it can reach the
ledger: when a masked round's member set is fixed (its mask keys are spent), and before
a round's sum is revealed. Every write goes through
:class:`~lensemble_flwr.artifacts.store.Store`, so a crash leaves either the previous
version or the new one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import canonical_json
from lensemble_flwr.errors import LedgerError
from lensemble_flwr.protocol.messages import Commitment
from lensemble_flwr.provenance.ledger import REGISTRY
from lensemble_flwr.secagg.membership import Membership


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


def load_registry(store: Store) -> tuple[dict[str, Commitment], Membership]:
    """The stored registry; empty when the run never bound anyone.

    Raises:
        LedgerError: the stored registry does not parse.
    """
    try:
        if not store.bound(REGISTRY):
            return {}, Membership()
        registry = _Registry.model_validate_json(store.get(store.resolve(REGISTRY)))
        commitments = {p: Commitment.model_validate(c) for p, c in registry.commitments.items()}
        membership = Membership.restore(registry.membership)
    except (ValidationError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise LedgerError(f"participant registry does not parse: {exc}") from None
    return commitments, membership
