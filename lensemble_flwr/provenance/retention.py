"""Checkpoint retention: prune the checkpoints a policy does not keep, crash-safely.

Every round's checkpoint (θ_r and its momentum, 8 bytes per parameter) stays in the
store unless :class:`~lensemble_flwr.config.RetentionConfig` says otherwise: keep the
newest ``keep-last-checkpoints`` rounds' and every ``keep-every-checkpoint``-th round's
(θ_0 counts as round 0). The ledger and the manifest are never pruned: every hash of
every round stays verifiable, and ``verify`` reports the pruned rounds.

Pruning a checkpoint is two steps, in this order:

1. the marker ``pruned/<digest>`` is bound to a note of the round (:func:`is_pruned
   <lensemble_flwr.provenance.ledger.is_pruned>` reads it), durably;
2. the blob is deleted.

A crash between the two leaves a marked checkpoint that is still there: it is read and
verified as a kept one, and the next pruning pass deletes it. A crash before step 1
leaves the checkpoint unmarked and whole. Either way the run directory verifies and
resumes. What resuming and a joining participant read — the newest checkpoint and a
pending external step's — is never pruned, whatever the policy says.
"""

from __future__ import annotations

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import canonical_json
from lensemble_flwr.config import RetentionConfig
from lensemble_flwr.provenance.ledger import (
    MANIFEST_HEADER,
    ContributionRecord,
    ExternalStep,
    RunManifest,
    ledger_name,
    load_external_step,
    parse_document,
    pruned_name,
)


def checkpoints_of(store: Store, round: int) -> list[str]:
    """The checkpoint blobs that hold θ_``round``: the round's own (θ_0's is the
    manifest's initial checkpoint) and the model an external step adopted after it, if
    any: the one the next round's record names or, for the newest round, the pending
    one (kept under ``coordinator/external-step``) the next round will train from.

    Raises:
        StoreError, LedgerError: a record or the manifest header cannot be read.
    """
    if round == 0:
        header = RunManifest.from_header(store.get(store.resolve(MANIFEST_HEADER)))
        digests, state = [header.initial_checkpoint], header.initial_params_hash
    else:
        record = _record(store, round)
        digests, state = [record.checkpoint], record.new_global_hash
    step = step_after(store, round, state)
    if step is not None:
        digests.append(step.checkpoint)
    return digests


def step_after(store: Store, round: int, committed_hash: str) -> ExternalStep | None:
    """The external step that replaced θ_``round`` (which hashes to ``committed_hash``)
    before the next round trained: the one round+1's record names or, for the newest
    round, the pending one (kept under ``coordinator/external-step``); None if none did.

    Raises:
        StoreError, LedgerError: a record or the pending step cannot be read.
    """
    if store.bound(ledger_name(round + 1)):
        return _record(store, round + 1).external_step
    step = load_external_step(store)
    return step if step is not None and step.committed_hash == committed_hash else None


def _record(store: Store, round: int) -> ContributionRecord:
    name = ledger_name(round)
    return parse_document(ContributionRecord, store.get(store.resolve(name)), name)


def prune(store: Store, digest: str, round: int) -> bool:
    """Mark the checkpoint blob ``digest`` (of θ_``round``) pruned, then delete it;
    returns whether it was there (a pruned one is left as it is).

    Raises:
        StoreError: the marker or the deletion was refused (what was done stays valid).
    """
    if not store.has(digest):
        return False
    note = store.put(canonical_json({"checkpoint": digest, "round": round}))
    store.bind(pruned_name(digest), note)
    return store.delete(digest)


def prune_checkpoints(
    store: Store, policy: RetentionConfig, head: ContributionRecord, *, since: int = 0
) -> int:
    """Prune what ``policy`` does not keep of θ_``since`` … θ_{head.round - keep-last},
    ``head`` being the newest committed round's record.

    Returns:
        The first round not considered yet: pass it as ``since`` after the next commit
        (so each round's checkpoints are looked at once; 0 looks at the whole run).

    Raises:
        StoreError, LedgerError: a record could not be read or a write was refused;
            every checkpoint pruned so far stays pruned, and the others stay whole.
    """
    if not policy.prunes:
        return since
    protected = set(checkpoints_of(store, head.round))  # what resuming and joiners read
    for round in range(since, head.round + 1):
        if policy.keeps(round, head.round):
            continue
        for digest in checkpoints_of(store, round):
            if digest not in protected:
                prune(store, digest, round)
    # the rounds before the newest N are decided for good: the next call starts after them
    return max(since, head.round - policy.keep_last_checkpoints + 1)
