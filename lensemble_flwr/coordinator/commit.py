"""The commit sequence of a closed round, and the manifest entry of any attempt.

:func:`commit_round` runs a revealed round to its end, in this order; the ledger record
is the commit point:

1. the outer step: θ_r and m_r from θ_{r-1}, m_{r-1} and the mean update;
2. the checkpoint of θ_r and its momentum, streamed to the store and hashed as it is
   written (:meth:`~lensemble_flwr.artifacts.store.Store.put_parts`), then read back from
   disk and re-hashed (:meth:`~lensemble_flwr.artifacts.store.Store.read_back`): the
   record names a blob that was verified where it lies, whether this commit wrote it or
   found it already stored under its digest (a blob there is not trusted unread). One
   that does not read back raises CheckpointIntegrityError and is removed, so a later
   attempt writes it afresh; whoever reads it later re-hashes it again;
3. the closing manifest entry, kept (:func:`~.durable.save_closing`) so that a crash
   right after the commit loses nothing;
4. the ledger record, chained to the previous one — from here on the round is committed;
5. the swap: the run held in memory (:class:`HeldRun`) moves to θ_r, m_r and the new
   ledger head, and the attempt is CLOSED;
6. the manifest entry of the closed round;
7. retention: the checkpoints the policy keeps no more are pruned
   (:mod:`~lensemble_flwr.provenance.retention`).

Nothing before the record changes anything a reader of the run directory trusts: a
failure there raises, and the attempt aborts with the global state untouched. The one
rule after the commit point: nothing undoes the round. A step that fails is logged
("round r committed; … failed"); a failed manifest entry is handed back to be raised
once the round is announced (the store is failing: the run stops, and resume completes
the entry from the kept closing one), and retention is then skipped; failed pruning is
left to the next commit.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from lensemble_flwr.aggregation.fixed_point import AggregateSum
from lensemble_flwr.artifacts.checkpoint import checkpoint_parts
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import HASH_ON_A_THREAD_MIN_BYTES, digest_arrays
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.attempt import Attempt
from lensemble_flwr.coordinator.durable import save_closing
from lensemble_flwr.coordinator.endorsements import endorsements_of
from lensemble_flwr.coordinator.external_step import SteppedFrom
from lensemble_flwr.coordinator.outer_optimizer import outer_step
from lensemble_flwr.errors import LensembleError
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.privacy.guarantee import PrivacyGuarantee
from lensemble_flwr.protocol.round import RoundEvent, RoundMachine, RoundState
from lensemble_flwr.protocol.state import GlobalState
from lensemble_flwr.provenance.ledger import (
    REGISTRY,
    ContributionRecord,
    ExternalStep,
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
        epsilon=claimed_epsilon(attempt),
    )


def claimed_epsilon(attempt: Attempt) -> dict[str, float] | None:
    """The cumulative epsilon each update ``attempt`` admitted claimed (None: none did)."""
    claimed = {p: e for p, e in sorted(attempt.epsilon.items()) if e is not None}
    return claimed or None


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
    """Steps 2–4 of the module's order; returns once the ledger holds the round.

    ``new_state`` may be given as the call that pins (and hashes) it: it then runs while
    the momentum is hashed on another thread (two model-sized hashes at once). The
    sums' digest is hashed on a thread while the checkpoint is written and fsynced.

    Raises:
        StoreError, LedgerError: the store refused a write (nothing is committed).
        CheckpointIntegrityError: the checkpoint did not read back (nothing is committed).
    """
    t = attempt.round  # round t takes θ_{t-1} to θ_t: its checkpoint is θ_t's
    new_state, momentum_hash = _pinned(new_state, momentum)
    result.hash_in_background()  # the sums' digest, for the entry: while the blob is written
    digest = store.put_parts(
        checkpoint_parts(
            t, new_state.params, momentum, params_hash=new_state.params_hash,
            momentum_hash=momentum_hash,
        )
    )  # fmt: skip
    store.read_back(digest)  # what the record will name, as it lies on disk
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
        _record_of(store, attempt, entry, digest, manifest, head_hash=head_hash, privacy=privacy)
    )
    return Committed(state=new_state, momentum=momentum, entry=entry, record=record)


def _record_of(
    store: Store,
    attempt: Attempt,
    entry: RoundEntry,
    checkpoint: str,
    manifest: RunManifest,
    *,
    head_hash: str,
    privacy: PrivacyGuarantee | None,
) -> ContributionRecord:
    """The ledger record of ``attempt``'s closing ``entry``: what it commits to (the
    header, its round's entries, the registry, the record before it and that record's
    endorsements, the checkpoint)."""
    return ContributionRecord(
        **entry.model_dump(include=_RECORDED_FROM_ENTRY),
        previous_global_hash=entry.prior_global_hash,
        frame_drift=entry.diagnostics.get("frame_drift"),
        dataset_roots={p: attempt.roots[p] for p in entry.contributors},
        epsilon={p: attempt.epsilon.get(p) for p in entry.contributors},
        checkpoint=checkpoint,
        header_digest=header_digest(manifest),
        entries_digest=entries_digest(
            [*(e for e in manifest.rounds if e.round == attempt.round), entry]
        ),
        registry_digest=store.resolve(REGISTRY) if store.bound(REGISTRY) else None,
        previous_record_hash=head_hash,
        endorsements=endorsements_of(attempt, head_hash),
        privacy=privacy,
    )


def _pinned(
    new_state: GlobalState | Callable[[], GlobalState], momentum: NamedArrays
) -> tuple[GlobalState, str | None]:
    """θ_r pinned, and m_r's digest if it was hashed here (else None: the checkpoint
    hashes it as it is written). Given as the call that pins θ_r, it runs while the
    momentum is hashed on another thread (two model-sized hashes at once)."""
    if not callable(new_state):
        return new_state, None
    if sum(a.nbytes for a in momentum.values()) < HASH_ON_A_THREAD_MIN_BYTES:
        hashed = digest_arrays(momentum, "momentum")  # small: a thread would cost more
        return new_state(), hashed
    with ThreadPoolExecutor(1, thread_name_prefix="lensemble-momentum-digest") as pool:
        momentum_hash = pool.submit(digest_arrays, momentum, "momentum")
        state = new_state()
        return state, momentum_hash.result()


@dataclasses.dataclass(frozen=True)
class RunHead:
    """The committed state a round starts from: θ, its momentum and the ledger head."""

    state: GlobalState  # the global state the next round starts from
    momentum: NamedArrays  # the outer optimizer's momentum with it
    record_hash: str  # the ledger's head record (GENESIS before the first commit)


@dataclasses.dataclass
class HeldRun:
    """The run as a coordinator holds it in memory: what a commit swaps and updates.

    Attributes:
        head: the committed state the next round starts from.
        manifest: the run's manifest header and the current round's entries.
        external_step: how ``head`` replaced the last commit's model, if it did.
        stepped_from: θ_{r-1} and m_{r-1} of the last commit, while an external step
            may still change its model (until the next attempt begins).
        prune_from: the first round whose checkpoints retention still looks at.
    """

    head: RunHead
    manifest: RunManifest
    external_step: ExternalStep | None = None
    stepped_from: SteppedFrom | None = None
    prune_from: int = 0


@dataclasses.dataclass(frozen=True)
class CommitContext:
    """What every commit of a run writes with, fixed when the coordinator is built."""

    store: Store
    ledger: Ledger
    config: LensembleConfig
    secure_sum: bool  # the round mode's: the outer step consumes a masked sum
    privacy: PrivacyGuarantee | None
    pin: Callable[..., GlobalState]  # (round, params, *, copy) -> θ_round, hashed


def commit_round(
    ctx: CommitContext,
    run: HeldRun,
    attempt: Attempt,
    result: AggregateSum,
    mean: NamedArrays,
    diagnostics: Mapping[str, float],
    on_transition: Callable[[RoundMachine], None] | None = None,
) -> tuple[Committed, BaseException | None]:
    """Run the module's sequence for a COMMITTING attempt whose sum was revealed
    (``mean`` is overwritten); at the commit point ``run`` is swapped and the attempt
    fires COMMITTED (told to ``on_transition``).

    Returns:
        The commit, and the manifest entry's failure (to raise once the round is
        announced), if it failed.

    Raises:
        StoreError, LedgerError: a write before the commit point was refused (nothing is
            committed, ``run`` is unchanged).
        CheckpointIntegrityError: the checkpoint did not read back (likewise).
    """
    head, groups = run.head, ctx.config.groups
    averaged = frozenset(n for n in attempt.state.params if groups.is_averaged(n))
    params, momentum = outer_step(  # m' is written over the mean (not used again)
        attempt.state.params, head.momentum, mean, ctx.config.outer, averaged,
        consume_mean=True,
    )  # fmt: skip
    committed = write_commit(
        ctx.store, ctx.ledger, attempt, result, diagnostics,
        lambda: ctx.pin(attempt.round, params, copy=False),  # θ_r: fresh arrays
        momentum, head_hash=head.record_hash, secure_sum=ctx.secure_sum,
        manifest=run.manifest, privacy=ctx.privacy,
    )  # fmt: skip
    # -- the commit point: the ledger holds the round; nothing below may abort it ------
    run.head = RunHead(committed.state, committed.momentum, committed.record.record_hash)
    run.stepped_from = SteppedFrom(attempt.state.params, head.momentum, averaged)
    run.external_step = None
    attempt.machine.fire(RoundEvent.COMMITTED)
    if on_transition is not None:
        on_transition(attempt.machine)
    _say_unbound(committed.record)
    # the closed round's entries stay in the store only: memory does not grow
    manifest, next_round = run.manifest, committed.state.next_round
    entry, failure = after_commit_point(
        attempt.round, "its manifest entry",
        lambda: manifest.with_round(ctx.store, committed.entry).since(next_round), Exception,
    )  # fmt: skip
    if entry is None:  # the evidence is incomplete: keep every checkpoint for now
        return committed, failure
    run.manifest, retention = entry, ctx.config.retention
    pruned, _ = after_commit_point(
        attempt.round,
        "pruning old checkpoints",
        lambda: prune_checkpoints(ctx.store, retention, committed.record, since=run.prune_from),
        (LensembleError, OSError),
    )
    run.prune_from = run.prune_from if pruned is None else pruned
    return committed, None


_T = TypeVar("_T")


def after_commit_point(
    round: int,
    what: str,
    step: Callable[[], _T],
    caught: type[BaseException] | tuple[type[BaseException], ...],
) -> tuple[_T | None, BaseException | None]:
    """Run one step after round ``round``'s commit point under the module's rule: what
    it raises of ``caught`` is logged, never undoes the round, and is handed back.

    Returns:
        ``(its result, None)``, or ``(None, the error)`` once it failed.
    """
    try:
        return step(), None
    except caught as exc:
        log.error("round %d committed; %s failed: %r", round, what, exc)
        return None, exc


def _say_unbound(record: ContributionRecord) -> None:
    """Name the contributions the round summed without a dataset commitment: an INFO
    line, since the WARNING is said once per participant when its first unbound update
    is admitted (a stock app's nodes are unbound every round)."""
    if unbound := record.unbound:
        more = f" and {len(unbound) - 5} more (lensemble-flwr show lists them)"
        log.info(
            "round %d closed with UNBOUND contributions (no dataset commitment) from %s%s",
            record.round,
            ", ".join(unbound[:5]),
            more if len(unbound) > 5 else "",
        )
