"""The round runtime on the in-process transport: the specification's testing strategy."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from federation_helpers import federation, small_config

from lensemble_flwr.aggregation.fixed_point import AggregateSum, FixedPointAggregator
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import AggregationConfig
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.errors import (
    CheckpointIntegrityError,
    CommitmentMismatch,
    FaultToleranceExceeded,
    LedgerError,
    LensembleError,
    NonDeterministicAggregation,
    ResidencyViolation,
    StoreError,
)
from lensemble_flwr.participant.participant import Participant
from lensemble_flwr.protocol.messages import MessageKind
from lensemble_flwr.protocol.round import RoundEvent, RoundState
from lensemble_flwr.provenance.ledger import Ledger, RunManifest
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.transports.faults import FaultPlan

PROGRESS = [
    RoundState.OPEN,
    RoundState.COLLECTING,
    RoundState.AGGREGATING,
    RoundState.ALIGNING,
    RoundState.COMMITTING,
    RoundState.CLOSED,
]


def states_of(coordinator) -> list[RoundState]:
    return list(coordinator.attempt.path())


def test_happy_path_walks_all_six_states_and_commits(tmp_path: Path) -> None:
    coordinator, network, nodes = federation(tmp_path)
    before = coordinator.global_state()
    coordinator.run(1)
    network.flush()

    assert states_of(coordinator) == PROGRESS
    assert coordinator.round_state() is RoundState.CLOSED
    after = coordinator.global_state()
    assert after.round == 1 and after.params_hash != before.params_hash
    outcome = coordinator.outcomes[-1]
    assert outcome.count == 4 and outcome.contributors == ("p00", "p01", "p02", "p03")
    # every participant heard the close, with the new hash
    assert {n.last_close.global_hash for n in nodes} == {after.params_hash}
    records = verify(Store(tmp_path / "run"))
    assert [r.round for r in records] == [1]  # Flower's numbering: the first round is 1
    assert records[0].count == 4 and records[0].new_global_hash == after.params_hash
    assert set(records[0].dataset_roots.values()) == {n.dataset_root for n in nodes}
    assert RunManifest.load(Store(tmp_path / "run")) == coordinator.manifest
    assert network.crashes == []


def test_many_rounds_reduce_the_loss_and_ledger_chains(tmp_path: Path) -> None:
    from lensemble_flwr.simulations.toy import global_loss

    coordinator, _, nodes = federation(tmp_path)
    trainers = [n.trainer for n in nodes]
    start = global_loss(coordinator.global_state().params, trainers)
    coordinator.run(6)
    assert global_loss(coordinator.global_state().params, trainers) < 0.5 * start
    records = verify(Store(tmp_path / "run"))
    assert [r.round for r in records] == list(range(1, 7))  # rounds 1 … 6
    assert all(b.previous_record_hash == a.record_hash for a, b in itertools.pairwise(records))


def assert_aborted_unchanged(coordinator, before_hash: str, error: type) -> None:
    assert coordinator.round_state() is RoundState.ABORTED
    assert coordinator.global_state().params_hash == before_hash
    last = coordinator.outcomes[-1]
    assert last.state is RoundState.ABORTED and isinstance(last.error, error)
    assert coordinator.attempt.machine.history[-1][1] is RoundEvent.ABORT


def test_quorum_not_reached_by_open_timeout_aborts_then_stops(tmp_path: Path) -> None:
    cfg = small_config(min_participants=5, max_round_attempts=2)
    coordinator, _network, _ = federation(tmp_path, participants=4, config=cfg)
    before = coordinator.global_state().params_hash
    with pytest.raises(
        FaultToleranceExceeded, match=r"open deadline \(10 s, lensemble\.open-timeout;"
    ):
        coordinator.run(1)
    assert_aborted_unchanged(coordinator, before, FaultToleranceExceeded)
    assert [o.attempt for o in coordinator.outcomes] == [1, 2]  # retried once, then stopped
    manifest = RunManifest.load(Store(tmp_path / "run"))
    assert [e.state for e in manifest.rounds] == [RoundState.ABORTED] * 2
    assert Ledger(Store(tmp_path / "run")).head() is None


def test_dropout_below_quorum_aborts_and_retry_after_rejoin_closes(tmp_path: Path) -> None:
    faults = (
        FaultPlan()
        .drop("p01", round=1, at=RoundState.COLLECTING)
        .drop("p02", round=1, at=RoundState.COLLECTING)
        .rejoin("p01", round=1)
        .rejoin("p02", round=1)
    )
    coordinator, _network, _ = federation(tmp_path, participants=4, faults=faults)
    before = coordinator.global_state().params_hash
    coordinator.run(1)
    first, second = coordinator.outcomes
    assert first.state is RoundState.ABORTED and isinstance(first.error, FaultToleranceExceeded)
    assert second.state is RoundState.CLOSED and second.attempt == 2 and second.count == 4
    # the aborted attempt changed nothing: the retry started from the same global state
    manifest = RunManifest.load(Store(tmp_path / "run"))
    assert manifest.rounds[0].prior_global_hash == manifest.rounds[1].prior_global_hash == before
    assert manifest.rounds[0].new_global_hash is None
    verify(Store(tmp_path / "run"))


def test_dropout_above_quorum_completes_elastically_with_recorded_ct(tmp_path: Path) -> None:
    faults = FaultPlan().drop("p03", round=2, at=RoundState.COLLECTING)
    coordinator, _network, _ = federation(tmp_path, participants=5, faults=faults)
    coordinator.run(3)
    assert [o.count for o in coordinator.outcomes] == [5, 4, 4]
    assert all(o.state is RoundState.CLOSED for o in coordinator.outcomes)
    records = verify(Store(tmp_path / "run"))
    assert [r.count for r in records] == [5, 4, 4]
    assert "p03" not in records[1].contributors
    # dropping mid-round did not wait for the deadline: the transport reported it gone
    assert coordinator.outcomes[1].elapsed < small_config().federation.collect_timeout


def test_rejoiner_absent_for_several_rounds_recovers_and_contributes(tmp_path: Path) -> None:
    faults = FaultPlan().drop("p02", round=2, at=RoundState.OPEN).rejoin("p02", round=5)
    coordinator, network, nodes = federation(tmp_path, participants=4, faults=faults)
    joined = []
    original_join = nodes[2].join
    nodes[2].join = lambda endpoint: joined.append(original_join(endpoint)) or joined[-1]
    coordinator.run(5)
    assert [o.count for o in coordinator.outcomes] == [4, 3, 3, 3, 4]
    assert "p02" in coordinator.outcomes[-1].contributors
    # join recovered the latest committed state (θ_4, the one round 5 started from)
    records = Ledger(Store(tmp_path / "run")).records()
    assert joined[0].round == 4 and joined[0].params_hash == records[3].new_global_hash
    assert network.crashes == []


def test_rejoin_refuses_a_tampered_checkpoint(tmp_path: Path) -> None:
    coordinator, _, nodes = federation(tmp_path)
    coordinator.run(2)
    store = Store(tmp_path / "run")
    head = Ledger(store).head()
    blob = store.root / "blobs" / head.checkpoint[:2] / head.checkpoint
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0x01
    blob.write_bytes(bytes(data))
    with pytest.raises(CheckpointIntegrityError):
        nodes[0].join(str(store.root))


def test_late_update_is_dropped_and_its_sender_contributes_next_round(tmp_path: Path) -> None:
    cfg = small_config()
    # p01's round-1 update lands after the round-1 deadline, while round 2 is collecting
    faults = FaultPlan().delay("p01", round=1, seconds=cfg.federation.collect_timeout - 0.5)
    coordinator, _network, _ = federation(tmp_path, faults=faults, config=cfg)
    coordinator.run(3)
    r0, r1, r2 = coordinator.outcomes
    assert r0.count == 3 and "p01" not in r0.contributors
    # its round-1 update arrives during round 2 and is logged as late, never admitted
    assert "p01" in r1.late and "p01" in r1.contributors
    assert all(o.state is RoundState.CLOSED for o in (r0, r1, r2))
    manifest = RunManifest.load(Store(tmp_path / "run"))
    assert "p01" not in manifest.rounds[0].update_digests


def test_identical_seeds_give_identical_manifests_and_digests(tmp_path: Path) -> None:
    faults = lambda: FaultPlan().drop("p03", round=2, at=RoundState.COLLECTING)  # noqa: E731
    runs = []
    for name in ("a", "b"):
        coordinator, _, _ = federation(tmp_path, faults=faults(), name=name)
        coordinator.run(3)
        store = Store(tmp_path / name)
        digests = [r.aggregate_digest for r in Ledger(store).records()]
        runs.append((RunManifest.load(store).digest, digests))
    assert runs[0] == runs[1]


def test_arrival_order_does_not_change_the_aggregate(tmp_path: Path) -> None:
    digests = []
    for name, order in (("fwd", [0, 1, 2, 3]), ("rev", [3, 2, 1, 0]), ("mix", [2, 0, 3, 1])):
        coordinator, network, nodes = federation(tmp_path, name=name)
        for rank, index in enumerate(order):
            network.set_compute_time(nodes[index].participant_id, 1.0 + rank)
        coordinator.run(2)
        arrivals = [
            d[1] for d in network.delivered if d[3] == MessageKind.UPDATE.value and d[4] == 1
        ]
        assert arrivals == [nodes[i].participant_id for i in order]
        store = Store(tmp_path / name)
        digests.append([(r.aggregate_digest, r.new_global_hash) for r in Ledger(store).records()])
    assert digests[0] == digests[1] == digests[2]


class CorruptingAggregator(FixedPointAggregator):
    """Corrupts its sum in place once everything is folded: the first accumulator only (a
    one-off fault, which the re-sum computed from the inputs does not share), or, when
    ``persistent``, the re-sum's too."""

    def __init__(self, *args, persistent: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.persistent = persistent
        self.frozen: list[str] = []

    def _frozen(self, *, resum: bool) -> AggregateSum:
        self._fold()
        if not resum or self.persistent:
            accs = self._resum_acc if resum else self._acc
            next(iter(accs.values())).reshape(-1)[0] += 1
        self.frozen.append("resum" if resum else "sum")
        return super()._frozen(resum=resum)


def corrupting(persistent: bool, log: list):
    def factory(template, config: AggregationConfig, seed: int):
        agg = CorruptingAggregator(template, config, check_seed=seed, persistent=persistent)
        log.append(agg)
        return agg

    return factory


def test_forced_determinism_mismatch_resums_once_then_aborts(tmp_path: Path) -> None:
    made: list = []
    factory = corrupting(persistent=True, log=made)
    coordinator, _network, _ = federation(tmp_path, aggregator_factory=factory)
    before = coordinator.global_state().params_hash
    with pytest.raises(NonDeterministicAggregation):
        coordinator.run(1)
    assert made[0].frozen == ["sum", "resum"]  # the single re-sum happened
    assert_aborted_unchanged(coordinator, before, NonDeterministicAggregation)
    assert len(coordinator.outcomes) == 1  # stop, no retry
    assert Ledger(Store(tmp_path / "run")).head() is None


def test_a_one_off_corruption_of_the_sum_is_recovered_by_the_resum(tmp_path: Path) -> None:
    """The re-sum is computed from the admitted inputs, not re-read from the corrupted
    accumulator: the round commits the same sum and model as an honest run."""
    made: list = []
    coordinator, _, _ = federation(tmp_path, aggregator_factory=corrupting(False, made))
    coordinator.run(1)
    assert made[0].frozen == ["sum", "resum"] and coordinator.round_state() is RoundState.CLOSED
    honest, _, _ = federation(tmp_path, name="honest")
    honest.run(1)
    (got,), (want,) = Ledger(Store(tmp_path / "run")).records(), honest_records(tmp_path)
    assert (got.aggregate_digest, got.new_global_hash) == (
        want.aggregate_digest,
        want.new_global_hash,
    )


def honest_records(tmp_path: Path) -> list:
    return Ledger(Store(tmp_path / "honest")).records()


def test_update_bound_to_another_dataset_root_aborts_fail_closed(tmp_path: Path) -> None:
    def forge_root(payload: dict) -> dict:
        payload["dataset_root"] = "f" * 64
        return payload

    faults = FaultPlan().corrupt("p02", round=2, kind=MessageKind.UPDATE, mutate=forge_root)
    coordinator, _, _ = federation(tmp_path, faults=faults)
    coordinator.run(1)
    before = coordinator.global_state().params_hash
    with pytest.raises(CommitmentMismatch, match="p02"):
        coordinator.run(1)
    assert_aborted_unchanged(coordinator, before, CommitmentMismatch)
    assert len(coordinator.outcomes) == 2  # no retry after a commitment mismatch
    verify(Store(tmp_path / "run"))  # round 1 stays committed and verifiable


class RottingStore(Store):
    """A store whose checkpoint blobs rot on disk right after they are written."""

    rot = False

    def put_parts(self, parts) -> str:
        parts = list(parts)
        digest = super().put_parts(parts)
        if self.rot and b"lensemble-checkpoint" in bytes(parts[0][:400]):
            rot_blob(self, digest)
        return digest


def rot_blob(store: Store, digest: str) -> None:
    path = store.root / "blobs" / digest[:2] / digest
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))


def assert_nothing_committed(coordinator, store: Store, before: str) -> None:
    assert_aborted_unchanged(coordinator, before, CheckpointIntegrityError)
    assert Ledger(store).head() is None  # no record
    manifest = RunManifest.load(Store(store.root))
    assert [e.state for e in manifest.rounds] == [RoundState.ABORTED]  # no closed entry


def test_a_checkpoint_write_that_does_not_read_back_aborts_the_round(tmp_path: Path) -> None:
    """The commit reads its checkpoint back before the record names it: a blob that rots
    as it is written aborts the attempt (nothing committed), is removed, and the resumed
    run writes it afresh and commits."""
    from lensemble_flwr.simulations.toy import initial_params

    _, network, nodes = federation(tmp_path, name="scratch")
    store = RottingStore(tmp_path / "rot")
    coordinator = Coordinator(
        small_config(), transport=network.coordinator, initial_params=initial_params(), store=store
    )
    before = coordinator.global_state().params_hash
    store.rot = True
    with pytest.raises(CheckpointIntegrityError, match="reads back as"):
        coordinator.run(1)
    assert_nothing_committed(coordinator, store, before)
    assert len(coordinator.outcomes) == 1  # stop, no retry in this run
    resumed = Coordinator.resume(
        small_config(), transport=network.coordinator, store=Store(store.root)
    )
    resumed.run(1)
    assert resumed.round_state() is RoundState.CLOSED
    assert [r.round for r in verify(Store(store.root))] == [1]
    assert nodes[0].join(str(store.root)).params_hash == resumed.global_state().params_hash


def test_a_corrupt_blob_already_at_the_checkpoints_digest_is_not_trusted(
    tmp_path: Path,
) -> None:
    """A blob planted at the digest the round's checkpoint will have (found by running the
    same round on a twin) is read back, refused and removed: the round aborts with nothing
    committed, no reader is ever pointed at it, and the resumed run commits a good one."""
    twin, _, _ = federation(tmp_path, name="twin")
    twin.run(1)
    head = Ledger(Store(tmp_path / "twin")).head()
    assert head is not None and head.attempt == 1
    digest, good = head.checkpoint, Store(tmp_path / "twin").get(head.checkpoint)

    coordinator, network, nodes = federation(tmp_path)
    store = Store(tmp_path / "run")
    planted = store.root / "blobs" / digest[:2] / digest
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    before = coordinator.global_state().params_hash
    with pytest.raises(CheckpointIntegrityError, match=digest):
        coordinator.run(1)
    assert_nothing_committed(coordinator, store, before)
    assert not store.has(digest)  # the bad blob is gone: nothing can trust it later
    resumed = Coordinator.resume(small_config(), transport=network.coordinator, store=store)
    resumed.run(1)
    records = verify(store)  # every checkpoint a record names reads back
    assert [(r.round, r.attempt) for r in records] == [(1, 2)]
    assert nodes[0].join(str(store.root)).params_hash == resumed.global_state().params_hash


def test_a_corrupt_blob_at_the_initial_checkpoints_digest_does_not_start_the_run(
    tmp_path: Path,
) -> None:
    """θ_0's checkpoint, which the manifest names, is read back too: a corrupt blob under
    its digest stops the run from starting (removed), and the next start writes it."""
    twin, _, _ = federation(tmp_path, name="twin")
    digest = twin.manifest.initial_checkpoint
    good = Store(tmp_path / "twin").get(digest)
    store = Store(tmp_path / "run")
    planted = store.root / "blobs" / digest[:2] / digest
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_bytes(good[::-1])
    with pytest.raises(CheckpointIntegrityError, match=digest):
        federation(tmp_path)
    assert not store.has(digest) and not store.bound("manifest")
    coordinator, _, _ = federation(tmp_path)
    assert store.get(digest) == good
    coordinator.run(1)
    assert [r.round for r in verify(store)] == [1]


def test_a_checkpoint_that_rots_after_its_commit_is_refused_by_every_reader(
    tmp_path: Path,
) -> None:
    """A blob that rots on disk after the round committed is caught by whoever reads it
    next: ``verify`` names it, a resumed coordinator refuses it, a joining participant
    refuses it."""
    coordinator, _, nodes = federation(tmp_path)
    coordinator.run(1)
    store = Store(tmp_path / "run")
    head = Ledger(store).head()
    assert head is not None and head.round == 1
    rot_blob(store, head.checkpoint)
    with pytest.raises(LedgerError, match="round 1: checkpoint"):
        verify(Store(store.root))
    with pytest.raises(LedgerError, match=r"round 1: checkpoint: blob .* hashes to"):
        Coordinator.resume(small_config(), store=Store(store.root))
    with pytest.raises(CheckpointIntegrityError):
        nodes[0].join(str(store.root))


def test_malformed_update_is_rejected_and_the_round_closes_without_it(tmp_path: Path) -> None:
    def break_delta(payload: dict) -> dict:
        payload["delta"] = {k: np.full_like(v, np.nan) for k, v in payload["delta"].items()}
        return payload

    faults = FaultPlan().corrupt("p01", round=1, kind=MessageKind.UPDATE, mutate=break_delta)
    coordinator, _, _ = federation(tmp_path, faults=faults)
    coordinator.run(1)
    outcome = coordinator.outcomes[0]
    assert outcome.state is RoundState.CLOSED and outcome.rejected == 1
    assert "p01" not in outcome.contributors and outcome.count == 3


def test_a_run_directory_holds_one_run(tmp_path: Path) -> None:
    federation(tmp_path)
    with pytest.raises(StoreError, match="already holds a run"):
        federation(tmp_path)


def test_a_refusal_is_answered_as_the_error_table_says(tmp_path: Path) -> None:
    """A participant that refuses with an error whose response is to stop (a release that
    would leak a local group) stops the federation; other refusals only leave it out."""

    def refuse_with(error: str):
        def mutate(payload: dict) -> dict:
            keep = ("run_id", "round", "attempt", "sender", "participant_id")
            return {
                **{k: payload[k] for k in keep},
                "kind": MessageKind.REFUSAL.value,
                "error": error,
                "reason": "refused in the test",
            }

        return mutate

    faults = FaultPlan().corrupt(
        "p01", round=1, kind=MessageKind.UPDATE, mutate=refuse_with("ProbeError")
    )
    coordinator, _, _ = federation(tmp_path, faults=faults, name="probe")
    coordinator.run(1)
    assert coordinator.outcomes[-1].contributors == ("p00", "p02", "p03")

    faults = FaultPlan().corrupt(
        "p01", round=1, kind=MessageKind.UPDATE, mutate=refuse_with("ResidencyViolation")
    )
    coordinator, _, _ = federation(tmp_path, faults=faults, name="leak")
    with pytest.raises(ResidencyViolation, match="p01"):
        coordinator.run(1)
    assert_aborted_unchanged(
        coordinator, coordinator.global_state().params_hash, ResidencyViolation
    )


class BroadcastFails:
    """The coordinator's transport, except that broadcast raises — after checking that
    what it would announce is already committed: in the ledger and in the manifest."""

    def __init__(self, inner, store: Store, error: Exception) -> None:
        self.inner, self.store, self.error = inner, store, error
        self.seen: list[tuple[int, list[int], list[int]]] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def broadcast(self, message) -> None:
        ledger = [r.round for r in Ledger(self.store).records()]
        closed = [e.round for e in RunManifest.load(self.store).rounds if e.state == "closed"]
        self.seen.append((message.round, ledger, closed))
        raise self.error


@pytest.mark.parametrize(
    "error", [ConnectionError("the network is down"), StoreError("a typed error, too")]
)
def test_a_failure_after_the_commit_point_never_aborts_the_committed_round(
    tmp_path: Path, error: Exception
) -> None:
    coordinator, network, _ = federation(tmp_path)
    store = Store(tmp_path / "run")
    failing = BroadcastFails(network.coordinator, store, error)
    coordinator.transport = failing
    coordinator.run(2)
    # RoundClose was announced (and failed) only once checkpoint, ledger record and
    # manifest entry were written
    assert failing.seen == [(1, [1], [1]), (2, [1, 2], [1, 2])]
    assert [o.state for o in coordinator.outcomes] == [RoundState.CLOSED, RoundState.CLOSED]
    assert [r.round for r in verify(store)] == [1, 2]
    resumed = Coordinator.resume(coordinator.config, transport=network.coordinator, store=store)
    assert resumed.global_state().params_hash == coordinator.global_state().params_hash
    assert resumed.next_attempt() == 1
    resumed.run(1)
    assert [r.round for r in verify(store)] == [1, 2, 3]


def test_rejoin_refuses_a_forged_resealed_head(tmp_path: Path) -> None:
    """Somebody with write access replaces the head record by one that points at a forged
    checkpoint, with matching hashes (resealed): the checkpoint agrees with the record,
    which is all join used to check. The chain (and the close p00 saw) does not."""
    from lensemble_flwr.artifacts.checkpoint import decode_checkpoint, encode_checkpoint
    from lensemble_flwr.canonical import digest_arrays
    from lensemble_flwr.provenance.ledger import ledger_name

    coordinator, network, nodes = federation(tmp_path)
    coordinator.run(2)
    network.flush()
    store = Store(tmp_path / "run")
    head = Ledger(store).head()
    real = decode_checkpoint(store.get(head.checkpoint))
    forged_params = {n: a + 1.0 for n, a in real.params.items()}
    forged_digest = store.put(encode_checkpoint(real.round, forged_params, real.momentum))
    forged = head.model_copy(
        update={
            "checkpoint": forged_digest,
            "new_global_hash": digest_arrays(forged_params, "params"),
            "record_hash": "",
        }
    ).sealed()
    store.bind(ledger_name(head.round), store.put(forged.model_dump_json().encode()))
    assert decode_checkpoint(store.get(forged.checkpoint)).params_hash == forged.new_global_hash
    with pytest.raises(CheckpointIntegrityError, match="does not hold round 2 as it was announced"):
        nodes[0].join(str(store.root))  # it saw round 2 close
    restarted = Participant(
        coordinator.config,
        participant_id="p00",
        transport=network.transport_for("p00"),
        trainer=nodes[0].trainer,
    )
    restarted.import_state(nodes[0].export_state())  # the close it saw is part of its state
    with pytest.raises(CheckpointIntegrityError, match="as it was announced"):
        restarted.join(str(store.root))
    fresh = Participant(
        coordinator.config,
        participant_id="p09",
        transport=network.transport_for("p09"),
        trainer=nodes[0].trainer,
    )
    with pytest.raises(LensembleError, match=r"disagree|differ"):  # no close seen: the chain
        fresh.join(str(store.root))  # to the manifest breaks
