"""What an attempt writes when it ends: the commit of a closed round, the entry of any.

A round commits in this order, and the ledger record is the commit point:

1. the checkpoint of θ_r (round r's outcome) and its momentum, streamed to the store and
   hashed as it is written (:meth:`~lensemble_flwr.artifacts.store.Store.put_parts`; it
   is not read back: whoever reads it later — recovery, a joining participant, ``verify``
   — re-hashes it);
2. the closing manifest entry, kept (:func:`~.durable.save_closing`) so that a crash
   right after the commit loses nothing;
3. the ledger record, chained to the previous one — from here on the round is committed;
4. the manifest entry (by the caller, once the in-memory state moved).

Only after all of that does the coordinator announce the round (RoundClose). Nothing
before the record changes anything a reader of the run directory trusts. Then
:func:`retain` prunes the checkpoints the retention policy no longer keeps
(:mod:`~lensemble_flwr.provenance.retention`); a failure there is logged, never undoes
the commit, and the next commit tries again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

from lensemble_flwr.aggregation.fixed_point import AggregateSum
from lensemble_flwr.artifacts.checkpoint import checkpoint_parts
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import HASH_ON_A_THREAD_MIN_BYTES, digest_arrays
from lensemble_flwr.config import RetentionConfig
from lensemble_flwr.coordinator.attempt import Attempt
from lensemble_flwr.coordinator.durable import save_closing
from lensemble_flwr.errors import LensembleError
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.privacy.guarantee import PrivacyGuarantee
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.protocol.state import GlobalState
from lensemble_flwr.provenance.ledger import (
    REGISTRY,
    ContributionRecord,
    Ledger,
    RoundEntry,
    RunManifest,
    entries_digest,
    header_digest,
)
from lensemble_flwr.provenance.retention import prune_checkpoints

log = logging.getLogger(__name__)

_RECORDED_FROM_ENTRY = {
    "round",
    "attempt",
    "invited",
    "contributors",
    "count",
    "total_weight",
    "update_digests",
    "aggregate_digest",
    "new_global_hash",
    "round_seed",
    "external_step",
}
"""The ledger record's fields that are the closing manifest entry's, under the same name."""


@dataclasses.dataclass(frozen=True)
class Committed:
    """A round that reached its commit point."""

    state: GlobalState  # θ_r of the round r committed, pinned
    momentum: NamedArrays
    entry: RoundEntry  # its closing manifest entry
    record: ContributionRecord  # as appended to the ledger


def entry_of(
    attempt: Attempt,
    result: AggregateSum | None,
    diagnostics: Mapping[str, float],
    reason: str | None,
    *,
    secure_sum: bool,
    new_global_hash: str | None = None,
) -> RoundEntry:
    """The manifest entry of an attempt (closed when ``new_global_hash`` is given)."""
    closed = new_global_hash is not None
    return RoundEntry(
        round=attempt.round,
        attempt=attempt.number,
        state=RoundState.CLOSED if closed else RoundState.ABORTED,
        reason=reason,
        round_seed=attempt.state.sketch_seed,
        prior_global_hash=attempt.state.params_hash,
        contributors=result.contributors if result is not None else (),
        count=result.count if result is not None else 0,
        total_weight=result.total_weight if result is not None else 0,
        update_digests=dict(sorted(attempt.update_digests.items())),
        aggregate_digest=result.digest if result is not None else None,
        new_global_hash=new_global_hash,
        invited=tuple(sorted(attempt.invited)),
        late=tuple(sorted(attempt.late)),
        rejected=attempt.rejected,
        refused=dict(sorted(attempt.refused.items())),
        secure_sum=closed and secure_sum,
        diagnostics=dict(diagnostics),
        external_step=attempt.external_step,
    )


def write_commit(
    store: Store,
    ledger: Ledger,
    attempt: Attempt,
    result: AggregateSum,
    diagnostics: Mapping[str, float],
    new_state: GlobalState | Callable[[], GlobalState],
    momentum: NamedArrays,
    *,
    head_hash: str,
    secure_sum: bool,
    manifest: RunManifest,
    privacy: PrivacyGuarantee | None = None,
) -> Committed:
    """Steps 1–3 of the module's order; returns once the ledger holds the round.

    ``new_state`` may be given as the call that pins (and hashes) it: it then runs while
    the momentum is hashed on another thread (two model-sized hashes at once). The
    sums' digest is hashed on a thread while the checkpoint is written and fsynced.

    Raises:
        StoreError, LedgerError: the store refused a write (nothing is committed).
    """
    t = attempt.round  # round t takes θ_{t-1} to θ_t: its checkpoint is θ_t's
    if callable(new_state):
        if sum(a.nbytes for a in momentum.values()) < HASH_ON_A_THREAD_MIN_BYTES:
            hashed = digest_arrays(momentum, "momentum")  # small: a thread would cost more
            new_state = new_state()
        else:
            with ThreadPoolExecutor(1, thread_name_prefix="lensemble-momentum-digest") as pool:
                momentum_hash = pool.submit(digest_arrays, momentum, "momentum")
                new_state = new_state()
                hashed = momentum_hash.result()
    else:
        hashed = None
    result.hash_in_background()  # the sums' digest, for the entry: while the blob is written
    digest = store.put_parts(
        checkpoint_parts(
            t, new_state.params, momentum, params_hash=new_state.params_hash, momentum_hash=hashed
        )
    )
    entry = entry_of(
        attempt,
        result,
        diagnostics,
        None,
        secure_sum=secure_sum,
        new_global_hash=new_state.params_hash,
    )
    save_closing(store, entry)
    record = ledger.append(
        ContributionRecord(
            **entry.model_dump(include=_RECORDED_FROM_ENTRY),
            previous_global_hash=entry.prior_global_hash,
            frame_drift=entry.diagnostics.get("frame_drift"),
            dataset_roots={p: attempt.roots[p] for p in entry.contributors},
            epsilon={p: attempt.epsilon.get(p) for p in entry.contributors},
            checkpoint=digest,
            header_digest=header_digest(manifest),
            entries_digest=entries_digest(
                [*(e for e in manifest.rounds if e.round == t), entry]
            ),
            registry_digest=store.resolve(REGISTRY) if store.bound(REGISTRY) else None,
            previous_record_hash=head_hash,
            privacy=privacy,
        )
    )
    return Committed(state=new_state, momentum=momentum, entry=entry, record=record)


def retain(
    store: Store, policy: RetentionConfig, head: ContributionRecord, since: int
) -> int:
    """After the commit of ``head``'s round: prune what ``policy`` no longer keeps of the
    rounds from ``since`` on, and return where the next call starts. A refused write is
    logged and the same ``since`` returned: the round stays committed, and the next
    commit prunes what this one could not."""
    try:
        return prune_checkpoints(store, policy, head, since=since)
    except (LensembleError, OSError) as exc:
        log.error("round %d committed; pruning old checkpoints failed: %r", head.round, exc)
        return since
