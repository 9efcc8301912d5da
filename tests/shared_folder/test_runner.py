"""Rounds over a shared folder with no coordinator process.

The federation tests run real processes (forked from a server that imported torch once):
four of them, one folder, several rounds; a process that never starts; a claimant killed
before it publishes; and the broken variants — claim written as resolve-then-bind, waiting
skipped, nothing published — each caught by the invariants the healthy runs satisfy.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import shared_folder_worker
from shared_folder_worker import folder_config, identities_of, identity_of

from lensemble_flwr.artifacts.checkpoint import encode_checkpoint
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.artifacts.tensors import pack
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.coordinator.modes import MaskedMode, require_exchange
from lensemble_flwr.errors import (
    CheckpointIntegrityError,
    ClaimantDied,
    ConfigError,
    FaultToleranceExceeded,
    InconsistentSizes,
    LedgerError,
    LensembleError,
    RoundError,
    StoreError,
)
from lensemble_flwr.identity.endorsement import verify_run
from lensemble_flwr.protocol.messages import (
    Commitment,
    MessageKind,
    Refusal,
    Update,
    from_wire,
    message_digest,
    to_wire,
)
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import Ledger, RunManifest
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.shared_folder.barrier import FolderBarrier, SittingKey, Snapshot
from lensemble_flwr.shared_folder.decision import SittingDecider, check_sizes
from lensemble_flwr.shared_folder.records import (
    Announcement,
    FolderRecord,
    Genesis,
    Outcome,
    decode_genesis,
    decode_outcome,
    decode_record,
    encode,
    encode_record,
)
from lensemble_flwr.shared_folder.runner import SharedFolderParticipant
from lensemble_flwr.shared_folder.signed import document_body, sign_document
from lensemble_flwr.simulations import shared_folder_demo
from lensemble_flwr.simulations.inprocess import build
from lensemble_flwr.simulations.toy import ToyTrainer, initial_params
from lensemble_flwr.testing import ManualClock

FOUR = ["p00", "p01", "p02", "p03"]
_CTX = multiprocessing.get_context("forkserver")
# what the server imports once, so that every process forked from it starts at once (the
# server does not see the test's sys.path, so the worker module itself is not on the list;
# AdamW imports torch._dynamo on first use)
_CTX.set_forkserver_preload(
    [
        "torch",
        "torch._dynamo",
        "lensemble_flwr.shared_folder.runner",
        "lensemble_flwr.simulations.toy",
    ]
)


@dataclasses.dataclass
class Report:
    me: str
    exitcode: int | None
    data: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and "global_hash" in self.data

    @property
    def error(self) -> tuple[str, str] | None:
        error = self.data.get("error")
        return None if error is None else (error[0], error[1])


def launch(
    folder: Path,
    *,
    start: Sequence[str],
    then: tuple[Callable[[], bool], Sequence[str]] | None = None,
    participants: Sequence[str] = FOUR,
    rounds: int = 1,
    round_timeout: float = 20.0,
    publish_timeout: float = 20.0,
    limit: float = 40.0,
    **spec: Any,
) -> dict[str, Report]:
    """Run participant processes on ``folder``: ``start`` at once, then (optionally) the
    others once a condition holds; return each one's report."""
    reports = folder / "reports"
    reports.mkdir(parents=True, exist_ok=True)
    common = {
        "folder": str(folder),
        "participants": list(participants),
        "rounds": rounds,
        "round_timeout": round_timeout,
        "publish_timeout": publish_timeout,
        **spec,
    }
    processes: dict[str, Any] = {}

    def begin(names: Sequence[str]) -> None:
        for me in names:
            target = shared_folder_worker.run
            args = ({**common, "me": me}, str(reports / f"{me}.json"))
            processes[me] = _CTX.Process(target=target, args=args)
            processes[me].start()

    deadline = time.monotonic() + limit
    begin(start)
    if then is not None:
        condition, later = then
        while not condition():
            early = {me: p.exitcode for me, p in processes.items() if not p.is_alive()}
            assert time.monotonic() < deadline and len(early) < len(processes), (
                f"the others were never started (exited: {early}, reports: "
                f"{[p.read_text() for p in reports.iterdir()]})"
            )
            time.sleep(0.01)
        begin(later)
    try:
        for process in processes.values():
            process.join(max(0.0, deadline - time.monotonic()))
        hung = [me for me, p in processes.items() if p.is_alive()]
        assert not hung, f"{hung} still running after {limit}s"
    finally:
        for process in processes.values():
            if process.is_alive():
                process.kill()
                process.join()
    out = {}
    for me, process in processes.items():
        path = reports / f"{me}.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        out[me] = Report(me, process.exitcode, data)
    return out


def bound(folder: Path, name: str, run_id: str = "run") -> Callable[[], bool]:
    """A condition: ``name`` is bound in the run's store."""
    return lambda: (folder / "runs" / run_id / "names" / name).is_file()


def violations(
    reports: dict[str, Report], folder: Path, *, rounds: int, participants: Sequence[str] = FOUR
) -> list[str]:
    """What is wrong with a run that should have closed ``rounds`` rounds with everyone."""
    found = []
    failed = {me: r.error or f"exit code {r.exitcode}" for me, r in reports.items() if not r.ok}
    if failed:
        found.append(f"processes failed: {failed}")
    hashes = {r.data["global_hash"] for r in reports.values() if r.ok}
    if len(hashes) > 1:
        found.append(f"divergent weights: {len(hashes)} different global states")
    if any(r.ok and r.data["round"] != rounds for r in reports.values()):
        found.append("a process left at another round")
    deciders = Counter(
        (rnd, sitting) for r in reports.values() for rnd, sitting, _ in r.data.get("decided", [])
    )
    doubled = {f"{rnd}.{sitting}": n for (rnd, sitting), n in deciders.items() if n > 1}
    if doubled:
        found.append(f"sittings decided by more than one process: {doubled}")
    closed = Counter(
        rnd
        for r in reports.values()
        for rnd, _, state in r.data.get("decided", [])
        if state == "closed"
    )
    if [closed[t] for t in range(1, rounds + 1)] != [1] * rounds:  # rounds from 1
        found.append(f"aggregations per round: {dict(closed)}")
    try:
        reviews = verify_run(Store(folder / "runs" / "run"))  # endorsements included
        records = verify(Store(folder / "runs" / "run"))
    except LensembleError as exc:
        found.append(f"ledger does not verify: {exc}")
        return found
    if [r.status for r in reviews] != ["endorsed"] * len(records):
        found.append(f"endorsements: {[r.describe() for r in reviews]}")
    if [r.contributors for r in records] != [tuple(participants)] * rounds:
        found.append(f"ledger contributors: {[r.contributors for r in records]}")
    return found


# -- real processes ----------------------------------------------------------------------
def test_four_processes_three_rounds_one_aggregation_each_same_weights(tmp_path: Path) -> None:
    reports = launch(tmp_path, start=FOUR, rounds=3)
    assert violations(reports, tmp_path, rounds=3) == []
    assert all(r.data["deposited"] == [[t, 1] for t in range(1, 4)] for r in reports.values())


def test_a_process_that_never_starts_is_named_by_the_deadline(tmp_path: Path) -> None:
    reports = launch(tmp_path, start=FOUR[:3], round_timeout=1.0)
    for report in reports.values():
        assert report.error is not None
        kind, message = report.error
        assert kind == "RoundIncomplete"
        assert "no record from p03" in message
    deciders = [r for r in reports.values() if r.data["decided"]]
    assert len(deciders) == 1 and deciders[0].data["decided"] == [[1, 1, "incomplete"]]


def test_a_straggler_is_waited_for_in_the_next_sitting(tmp_path: Path) -> None:
    reports = launch(
        tmp_path,
        start=FOUR[:3],
        then=(bound(tmp_path, "barrier/00000001.001/outcome"), ["p03"]),
        round_timeout=2.0,  # sitting 2 waits this long for the straggler to start and train
        federation={"max_round_attempts": 2},
    )
    assert violations(reports, tmp_path, rounds=1) == []
    assert reports["p03"].data["deposited"] == [[1, 2]]  # it never saw sitting 1 open
    for me in FOUR[:3]:
        assert reports[me].data["deposited"] == [[1, 1], [1, 2]]
    manifest = RunManifest.load(Store(tmp_path / "runs" / "run"))
    entries = [(e.round, e.attempt, e.state) for e in manifest.rounds]
    assert entries == [(1, 1, RoundState.CLOSED)]  # nothing ran in the sitting nobody completed


def test_a_claimant_killed_before_publishing_is_named(tmp_path: Path) -> None:
    reports = launch(
        tmp_path,
        start=["p00"],
        then=(bound(tmp_path, "barrier/genesis"), FOUR[1:]),
        publish_timeout=1.0,
        mutant="killed-when-deciding",
    )
    killed = [r for r in reports.values() if r.exitcode == -signal.SIGKILL]
    assert len(killed) == 1
    dead = killed[0].me
    for report in reports.values():
        if report.me == dead:
            continue
        assert report.error is not None
        kind, message = report.error
        assert kind == "ClaimantDied"
        assert f"{dead} (pid " in message and "round 1 sitting 1" in message
        assert "RoundIncomplete" not in message


# -- the broken variants -----------------------------------------------------------------
def test_mutant_claim_as_resolve_then_bind_is_caught(tmp_path: Path) -> None:
    # the run is started first, so the race is the one for the decision
    reports = launch(
        tmp_path,
        start=["p00"],
        then=(bound(tmp_path, "barrier/genesis"), FOUR[1:]),
        mutant="claim-as-resolve-then-bind",
        publish_timeout=3.0,
    )
    found = violations(reports, tmp_path, rounds=1)
    assert any(v.startswith("sittings decided by more than one process") for v in found), found


@pytest.mark.parametrize("mutant", [None, "no-wait"])
def test_mutant_that_does_not_wait_is_caught(tmp_path: Path, mutant: str | None) -> None:
    # the last participant starts only once the other three deposited (or, broken, once the
    # sitting was decided without it): somebody has to wait for it
    sitting = "barrier/00000001.001"
    deposited = [bound(tmp_path, f"{sitting}/record/{p}") for p in FOUR[:3]]
    decided = bound(tmp_path, f"{sitting}/decision")
    reports = launch(
        tmp_path,
        start=FOUR[:3],
        then=(lambda: decided() or all(c() for c in deposited), ["p03"]),
        mutant=mutant,
    )
    found = violations(reports, tmp_path, rounds=1)
    if mutant is None:
        assert found == []
    else:
        assert any(v.startswith("processes failed") for v in found), found
        assert any(v.startswith("aggregations per round") for v in found), found


def test_mutant_that_does_not_publish_is_caught(tmp_path: Path) -> None:
    reports = launch(
        tmp_path, start=FOUR, rounds=2, round_timeout=1.0, publish_timeout=1.0, mutant="no-publish"
    )
    found = violations(reports, tmp_path, rounds=2)
    assert any(v.startswith("processes failed") for v in found), found
    errors = Counter(r.error[0] for r in reports.values() if r.error is not None)
    assert errors["ClaimantDied"] == 3, errors  # the waiters name the one that kept it


# -- in one process: the protocol's rules ------------------------------------------------
def node(
    folder: Path,
    me: str,
    participants: Sequence[str] = ("p00", "p01"),
    *,
    config: LensembleConfig | None = None,
    trainer: ToyTrainer | None = None,
    **kwargs: Any,
) -> SharedFolderParticipant:
    ids = list(participants)
    kwargs = {
        "run_id": "run",
        "round_timeout": 10.0,
        "publish_timeout": 10.0,
        "identity": identity_of(me),
        "identities": identities_of(ids),
        **kwargs,
    }
    return SharedFolderParticipant(
        folder,
        config=config or folder_config(min_participants=1),
        participant_id=me,
        trainer=trainer or ToyTrainer(ids.index(me)),
        participants=ids,
        initial_params=initial_params(),
        poll_interval=0.005,
        **kwargs,
    )


def together(nodes: Sequence[SharedFolderParticipant], rounds: int) -> list[Any]:
    """Run the nodes side by side (threads); each one's GlobalState or the error it raised."""

    def one(n: SharedFolderParticipant) -> Any:
        try:
            return n.run(rounds)
        except LensembleError as exc:
            return exc

    with ThreadPoolExecutor(len(nodes)) as pool:
        return list(pool.map(one, nodes))


def store_of(folder: Path, run_id: str = "run") -> Store:
    return Store(folder / "runs" / run_id)


def when(condition: Callable[[], bool], limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_the_same_weights_as_the_in_process_coordinator(tmp_path: Path) -> None:
    config = folder_config(min_participants=2)
    ids = ["p00", "p01", "p02"]
    states = together([node(tmp_path, p, ids, config=config) for p in ids], 2)
    coordinator, _, _ = build(config, tmp_path / "in-process", participants=3)
    coordinator.run(2)
    assert {s.params_hash for s in states} == {coordinator.global_state().params_hash}
    assert len(verify(store_of(tmp_path))) == 2

    # a participant arriving after the rounds were published reads them and does not wait
    late = node(tmp_path, "p01", ids, config=config, round_timeout=60.0)
    started = time.monotonic()
    assert late.run(2).params_hash == coordinator.global_state().params_hash
    assert time.monotonic() - started < 5.0
    assert (late.deposits, late.decisions) == ([], [])


def test_the_only_participant_decides_and_publishes_its_own_rounds(tmp_path: Path) -> None:
    solo = node(tmp_path, "p00", ["p00"])
    state = solo.run(2)
    assert [(d.key.round, d.state, d.contributors) for d in solo.decisions] == [
        (1, RoundState.CLOSED, ("p00",)),
        (2, RoundState.CLOSED, ("p00",)),
    ]
    outcome = decode_outcome(document_body(solo.barrier.outcome(SittingKey(2, 1)) or b""))
    assert outcome.global_hash == state.params_hash and outcome.next is not None
    assert outcome.decided_by == solo.identity
    assert [r.new_global_hash for r in verify(solo.store)][-1] == state.params_hash


def test_two_runs_sharing_a_folder_are_two_runs(tmp_path: Path) -> None:
    a = node(tmp_path, "p00", ["p00"], run_id="a", trainer=ToyTrainer(0))
    b = node(tmp_path, "p00", ["p00"], run_id="b", trainer=ToyTrainer(1))
    state_a, state_b = together([a, b], 2)
    alone = node(tmp_path / "alone", "p00", ["p00"], run_id="a", trainer=ToyTrainer(0)).run(2)
    assert state_a.params_hash == alone.params_hash != state_b.params_hash
    roots = [{r.dataset_roots["p00"] for r in verify(store_of(tmp_path, run))} for run in "ab"]
    assert len(roots[0]) == len(roots[1]) == 1 and roots[0] != roots[1]


def test_a_record_replayed_into_another_sitting_is_refused_loudly(
    tmp_path: Path, caplog: Any
) -> None:
    """p01's genuine round-1 record copied into its round-2 slot: it is signed for round
    1's slot, so the decider refuses it (it used to be admitted, filed as late), and p01
    itself, finding a record it did not write in its slot, stops and says so."""
    n0, n1 = node(tmp_path, "p00"), node(tmp_path, "p01")
    together([n0, n1], 1)
    store = store_of(tmp_path)
    old = store.get(store.resolve("barrier/00000001.001/record/p01"))
    n1.barrier.deposit(SittingKey(2, 1), "p01", old)  # round 1's record filed under round 2
    state = n0.run(2)
    assert "REFUSED the record in the slot of p01" in caplog.text
    assert "signed for run/barrier/00000001.001/record/p01" in caplog.text
    assert n1.run(2).params_hash == state.params_hash  # round 2 was decided: it walks on
    assert [r.contributors for r in verify(store)] == [("p00", "p01"), ("p00",)]
    assert RunManifest.load(store).rounds[-1].late == ()  # not admitted, not even as late


def test_a_record_filed_under_another_participant_is_left_out(tmp_path: Path) -> None:
    n0 = node(tmp_path, "p00")
    store = store_of(tmp_path)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(n0.run, 1)
        when(lambda: bool(store.bound("barrier/00000001.001/record/p00")))
        forged = store.get(store.resolve("barrier/00000001.001/record/p00"))
        n0.barrier.deposit(SittingKey(1, 1), "p01", forged)
        running.result()
    assert [r.contributors for r in verify(store)] == [("p00",)]


@pytest.mark.parametrize(
    ("change", "contributors"),
    [
        ({}, ("p00", "p01")),  # the record as answered: admitted
        ({"sitting": 2}, ("p00",)),  # says it is another sitting's
        ({"run_id": "other"}, ("p00",)),  # says it is another run's
        ({"round": 2}, ("p00",)),  # says round 2 and carries round 1's messages
    ],
)
def test_a_record_that_says_it_belongs_elsewhere_is_left_out(
    tmp_path: Path, change: dict[str, Any], contributors: tuple[str, ...], caplog: Any
) -> None:
    n0, n1 = node(tmp_path, "p00"), node(tmp_path, "p01")
    store = store_of(tmp_path)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(n0.run, 1)
        when(lambda: bool(store.bound("barrier/genesis")))
        genesis = decode_genesis(document_body(store.get(store.resolve("barrier/genesis"))))
        record = dataclasses.replace(n1.answer(genesis.first), **change)
        # p01 signs it for the slot it deposits it in: the header is what is wrong
        n1.barrier.deposit(SittingKey(1, 1), "p01", n1.seal_record(record, SittingKey(1, 1)))
        running.result()
    assert [r.contributors for r in verify(store)] == [contributors]
    assert ("record filed under p01 says" in caplog.text) == bool(change)


def test_sizes_all_or_none() -> None:
    def record(pid: str, size: int | None, update_size: int | None = 10) -> FolderRecord:
        update = {"kind": MessageKind.UPDATE.value, "num_examples": update_size}
        payloads = () if update_size is None else (update,)
        return FolderRecord("run", 1, 1, pid, size, payloads)

    check_sizes([record("a", 10), record("b", 10)])
    check_sizes([record("a", None), record("b", None)])
    check_sizes([record("a", 10), record("b", None, update_size=None)])  # b sent no update
    with pytest.raises(InconsistentSizes, match="a state their size and b do not"):
        check_sizes([record("a", 10), record("b", None)])
    with pytest.raises(InconsistentSizes, match="a states size 11 and its update says 10"):
        check_sizes([record("a", 11), record("b", 10)])


def test_records_that_disagree_about_sizes_stop_everyone(tmp_path: Path) -> None:
    config = folder_config(min_participants=1, weighting="num-examples")  # records state sizes
    n0, n1 = node(tmp_path, "p00", config=config), node(tmp_path, "p01", config=config)
    store = store_of(tmp_path)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(n0.run, 1)
        when(lambda: bool(store.bound("barrier/genesis")))
        genesis = decode_genesis(document_body(store.get(store.resolve("barrier/genesis"))))
        sizeless = dataclasses.replace(n1.answer(genesis.first), num_examples=None)
        n1.barrier.deposit(SittingKey(1, 1), "p01", n1.seal_record(sizeless))
        with pytest.raises(InconsistentSizes, match="p00 state their size and p01 do not"):
            running.result()
    with pytest.raises(InconsistentSizes):  # the late one reads the same verdict
        n1.run(1)
    assert Ledger(store).records() == []


def test_an_aborted_attempt_is_retried_then_stops_by_the_error_table(tmp_path: Path) -> None:
    config = folder_config(min_participants=3, max_round_attempts=2)  # two can never close
    n0, n1 = node(tmp_path, "p00", config=config), node(tmp_path, "p01", config=config)
    results = together([n0, n1], 1)
    assert all(isinstance(r, FaultToleranceExceeded) for r in results)
    manifest = RunManifest.load(store_of(tmp_path))
    attempts = [(e.attempt, e.state) for e in manifest.rounds]
    assert attempts == [(1, RoundState.ABORTED), (2, RoundState.ABORTED)]
    assert n0.deposits == n1.deposits == [SittingKey(1, 1), SittingKey(1, 2)]


def test_with_a_quorum_the_round_goes_on_without_the_missing(tmp_path: Path) -> None:
    ids = ["p00", "p01", "p02", "p03"]
    seen: list[Outcome] = []
    nodes = [
        node(tmp_path, p, ids, quorum=3, round_timeout=0.3, on_outcome=seen.append) for p in ids[:3]
    ]
    states = together(nodes, 1)
    assert len({s.params_hash for s in states}) == 1
    assert {(o.state, o.contributors, o.missing) for o in seen} == {
        (RoundState.CLOSED, ("p00", "p01", "p02"), ("p03",))
    }


def test_a_decider_that_fails_publishes_why(tmp_path: Path, monkeypatch: Any) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(Coordinator, "resume", broken)
    solo = node(tmp_path, "p00", ["p00"])
    with pytest.raises(LensembleError, match="RuntimeError: disk on fire"):
        solo.run(1)
    outcome = decode_outcome(document_body(solo.barrier.outcome(SittingKey(1, 1)) or b""))
    assert (outcome.state, outcome.error, outcome.next) == (
        RoundState.ABORTED,
        "RuntimeError",
        None,
    )


def test_a_config_error_while_deciding_reaches_everyone_with_its_field(
    tmp_path: Path, monkeypatch: Any
) -> None:
    def refuses(*args: Any, **kwargs: Any) -> Any:
        raise ConfigError("x", "y")

    first = node(tmp_path, "p00", ["p00", "p01"], quorum=1, round_timeout=0.1)
    with monkeypatch.context() as patch:
        patch.setattr(Coordinator, "resume", refuses)
        with pytest.raises(ConfigError) as decider:
            first.run(1)
    outcome = decode_outcome(document_body(first.barrier.outcome(SittingKey(1, 1)) or b""))
    assert (outcome.error, outcome.error_field, outcome.reason) == ("ConfigError", "x", "y")
    # a process arriving later reads the published outcome: the same error, rebuilt
    with pytest.raises(ConfigError) as late:
        node(tmp_path, "p01", ["p00", "p01"], quorum=1).run(1)
    assert (decider.value.field, decider.value.reason) == ("x", "y")
    assert (late.value.field, late.value.reason) == ("x", "y")


def test_a_closed_round_missing_from_the_ledger_is_refused(tmp_path: Path, monkeypatch) -> None:
    """The decider refuses to announce a closed round it cannot read back from the ledger
    (and so endorses nothing); the reader then refuses the record nobody endorsed."""
    monkeypatch.setattr(SittingDecider, "_committed_record", lambda self, r: None)
    with pytest.raises(LedgerError, match=r"round 1: ledger record \w+… is UNENDORSED"):
        node(tmp_path, "p00", ["p00"]).run(1)
    outcome = (tmp_path / "runs" / "run" / "names" / "barrier" / "00000001.001" / "outcome")
    published = Store(tmp_path / "runs" / "run").get(outcome.read_text().strip())
    assert b"does not hold the closed round" in published


# -- guards ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"participants": ["p00", "p00"]}, "participants"),
        ({"participants": []}, "participants"),
        ({"participants": ["p00", "a/b"]}, "participants"),
        ({"run_id": ".."}, "run_id"),
        ({"participant_id": "p09"}, "participant_id"),
        ({"quorum": 3}, "quorum"),
        ({"quorum": 0}, "quorum"),
        ({"config": folder_config(secagg_threshold=2)}, "secagg-threshold"),
    ],
)
def test_settings_that_cannot_work_are_refused(tmp_path: Path, kwargs: Any, field: str) -> None:
    args = {
        "config": folder_config(),
        "participant_id": "p00",
        "trainer": ToyTrainer(0),
        "participants": ["p00", "p01"],
        "initial_params": initial_params(),
        **kwargs,
    }
    with pytest.raises(ConfigError) as caught:
        SharedFolderParticipant(tmp_path, **args)
    assert caught.value.field == field
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_a_masked_config_is_refused_with_the_coordinators_own_refusal(tmp_path: Path) -> None:
    config = folder_config(secagg_threshold=2)
    with pytest.raises(ConfigError) as caught:
        SharedFolderParticipant(
            tmp_path,
            config=config,
            participant_id="p00",
            trainer=ToyTrainer(0),
            participants=["p00", "p01"],
            initial_params=initial_params(),
            unauthenticated=True,
        )
    # the same words as the coordinator's refusal of a batch (conclude_collected)
    with pytest.raises(ConfigError) as coordinators:
        require_exchange(MaskedMode(config, registry=None, run_id="r"), None)  # type: ignore[arg-type]
    assert (caught.value.field, caught.value.reason) == (
        coordinators.value.field,
        coordinators.value.reason,
    )
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_a_process_that_does_not_match_the_run_is_refused(tmp_path: Path) -> None:
    node(tmp_path, "p00", ["p00"]).run(0)  # creates the run
    other = LensembleConfig(
        federation={"min_participants": 1, "root_seed": 11, "max_round_attempts": 1},
        inner={"steps": 3, "lr": 0.05, "batch_size": 8},
    )
    with pytest.raises(ConfigError, match="inner-steps"):
        node(tmp_path, "p00", ["p00"], config=other).run(1)
    with pytest.raises(ConfigError, match=r"started with \['p00'\]"):
        node(tmp_path, "p00", ["p00", "p01"]).run(1)
    with pytest.raises(ValueError, match="rounds"):
        node(tmp_path, "p00", ["p00"]).run(-1)


# -- the barrier on its own (a simulated clock) -----------------------------------------
def barrier(store: Store, who: str, clock: ManualClock, **kwargs: Any) -> FolderBarrier:
    kwargs = {"round_timeout": 5.0, "publish_timeout": 2.0, **kwargs}
    return FolderBarrier(store, identity=who, clock=clock, sleep=clock.sleep, **kwargs)


def test_the_deadline_hands_the_decider_the_missing(tmp_path: Path) -> None:
    clock, store, key = ManualClock(), Store(tmp_path), SittingKey(1, 1)
    a = barrier(store, "A", clock)
    a.deposit(key, "a", b"from a")
    seen: list[Snapshot] = []
    outcome = a.gather(key, ["a", "b"], lambda s: seen.append(s) or b"decided")
    assert outcome == b"decided" and clock.now >= 5.0
    assert (dict(seen[0].records), seen[0].missing) == ({"a": b"from a"}, ("b",))
    # b comes late: it finds the outcome and does not wait, nor decide again
    b = barrier(store, "B", clock)
    b.deposit(key, "b", b"from b")
    before = clock.now
    assert b.gather(key, ["a", "b"], lambda s: pytest.fail("decided twice")) == b"decided"
    assert clock.now == before


def test_a_claim_never_published_is_named_after_the_publish_timeout(tmp_path: Path) -> None:
    clock, store, key = ManualClock(), Store(tmp_path), SittingKey(4, 2)
    store.claim(f"{key.name}/decision", store.put(b"C (pid 7 on node-4)"))
    b = barrier(store, "B", clock)
    b.deposit(key, "b", b"from b")
    with pytest.raises(ClaimantDied, match=r"round 4 sitting 2: C \(pid 7 on node-4\)") as err:
        b.gather(key, ["b"], lambda s: pytest.fail("the claim was taken over"))
    assert err.value.claimant == "C (pid 7 on node-4)"
    assert 2.0 <= clock.now < 2.5


def test_a_start_never_published_is_named_after_the_publish_timeout(tmp_path: Path) -> None:
    clock, store = ManualClock(), Store(tmp_path)
    store.claim("barrier/start", store.put(b"S (pid 9 on node-1)"))
    with pytest.raises(ClaimantDied, match=r"the run's start: S \(pid 9 on node-1\)"):
        barrier(store, "B", clock).start(lambda: pytest.fail("the start was taken over"))


def test_start_publishes_once_and_everyone_reads_it(tmp_path: Path) -> None:
    clock, store = ManualClock(), Store(tmp_path)
    assert barrier(store, "A", clock).start(lambda: b"genesis") == b"genesis"
    assert barrier(store, "B", clock).start(lambda: pytest.fail("created twice")) == b"genesis"
    # somebody who never held the start claim publishes a genesis while the claimant
    # creates the run: the claimant refuses to publish over it, and the first one stands
    rogue = Store(tmp_path / "rogue")

    def create() -> bytes:
        rogue.claim("barrier/genesis", rogue.put(b"another"))
        return b"genesis"

    with pytest.raises(StoreError, match="did not hold the claim"):
        barrier(rogue, "C", clock).start(create)
    assert rogue.get(rogue.resolve("barrier/genesis")) == b"another"


def test_a_record_is_deposited_once(tmp_path: Path) -> None:
    b, key = barrier(Store(tmp_path), "B", ManualClock()), SittingKey(1, 1)
    assert b.deposit(key, "b", b"first") is True
    assert b.deposit(key, "b", b"first") is False  # a restart writing the same again
    with pytest.raises(RoundError, match="already deposited a different record"):
        b.deposit(key, "b", b"second")
    assert b.deposited(key) == ["b"] and b.deposited(SittingKey(1, 2)) == []
    assert b.has_deposited(key, "b")
    assert not b.has_deposited(key, "c") and not b.has_deposited(SittingKey(1, 2), "b")


def test_barrier_arguments_that_cannot_work_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="round_timeout"):
        barrier(Store(tmp_path), "B", ManualClock(), round_timeout=0)
    with pytest.raises(ValueError, match="poll_interval"):
        barrier(Store(tmp_path), "B", ManualClock(), poll_interval=-1)
    with pytest.raises(ValueError):
        SittingKey(1, 0)


# -- what the bytes mean ---------------------------------------------------------------
def test_a_record_reads_back_to_the_same_messages() -> None:
    common = {"run_id": "run", "round": 3, "attempt": 1, "sender": "p1", "participant_id": "p1"}
    root = "ab" * 32
    messages = [
        Commitment(**common, dataset_root=root, num_examples=5),
        Update(
            **common,
            dataset_root=root,
            delta={"w": np.arange(6, dtype=np.int8).reshape(2, 3), "b": np.ones(2, np.int8)},
            l2_norm=1.5,
            num_examples=5,
            transforms=("clip", "quantize"),
            epsilon=0.25,
            scales={"w": 0.5, "b": 0.125},
        ),
        Refusal(**common, error="PrivacyBudgetExceeded", reason="spent"),
    ]
    record = FolderRecord("run", 2, 1, "p1", 5, tuple(to_wire(m) for m in messages))
    data = encode_record(record)
    assert encode_record(record) == data  # deterministic
    back = decode_record(data)
    assert dataclasses.replace(back, payloads=()) == dataclasses.replace(record, payloads=())
    assert [message_digest(from_wire(p)) for p in back.payloads] == [
        message_digest(m) for m in messages
    ]


_HEADER = {
    "format": "lensemble-folder-record/1",
    "run_id": "run",
    "round": 1,
    "sitting": 1,
    "participant": "p1",
    "num_examples": None,
    "payloads": [{"kind": MessageKind.REFUSAL.value}],
    "arrays": [[]],
}


@pytest.mark.parametrize(
    ("data", "complaint"),
    [
        (b"", "not lensemble safetensors"),
        (b"not a record", "not lensemble safetensors"),
        (b"\x08" + b"\x00" * 7 + b"{}", "not lensemble safetensors"),
        (pack({}, {**_HEADER, "round": -1}), "round"),
        (pack({}, {**_HEADER, "arrays": []}), "1 payloads and 0 lists of array fields"),
    ],
)
def test_bytes_that_are_not_a_record_are_refused(data: bytes, complaint: str) -> None:
    with pytest.raises(RoundError, match="unreadable shared-folder record") as caught:
        decode_record(data)
    assert complaint in str(caught.value)
    refusal = {"kind": MessageKind.REFUSAL.value}
    assert decode_record(pack({}, _HEADER)).payloads == (refusal,)  # the control


def test_a_stored_outcome_that_does_not_parse_is_refused() -> None:
    with pytest.raises(LedgerError, match="outcome does not parse"):
        decode_outcome(b'{"state": "closed"}')
    with pytest.raises(LedgerError, match="genesis does not parse"):
        decode_genesis(b"[]")


# -- a folder that does not say what it should ------------------------------------------
def forge_run(folder: Path, change: Callable[[Genesis], Genesis]) -> Store:
    """A run whose genesis was published by somebody else, changed by ``change``."""
    store = store_of(folder)
    coordinator = Coordinator(
        folder_config(min_participants=1),
        initial_params=initial_params(),
        store=store,
        run_id="run",
    )
    first = Announcement.of(
        {"p00": coordinator.round_open_for("p00")},
        sitting=1,
        checkpoint=coordinator.manifest.initial_checkpoint,
    )
    genesis = change(Genesis(run_id="run", participants=("p00",), created_by="X", first=first))
    store.claim("barrier/start", store.put(b"X"))
    signed = sign_document(identity_of("p00"), "p00", "run/genesis", encode(genesis))
    store.claim("barrier/genesis", store.put(signed))  # a participant published it
    return store


def test_an_announced_checkpoint_that_is_not_the_announced_state_is_refused(
    tmp_path: Path,
) -> None:
    other = {n: a + 1 for n, a in initial_params().items()}
    wrong = store_of(tmp_path).put(encode_checkpoint(0, other, other))  # a valid checkpoint
    forge_run(
        tmp_path,
        lambda g: g.model_copy(update={"first": g.first.model_copy(update={"checkpoint": wrong})}),
    )
    with pytest.raises(CheckpointIntegrityError, match="does not hold the announced"):
        node(tmp_path, "p00", ["p00"]).run(1)


def test_a_run_whose_store_moved_on_is_not_aggregated(tmp_path: Path) -> None:
    def attempt_two(g: Genesis) -> Genesis:
        opens = {p: {**f, "attempt": 2} for p, f in g.first.round_opens.items()}
        return g.model_copy(update={"first": g.first.model_copy(update={"round_opens": opens})})

    store = forge_run(tmp_path, attempt_two)
    with pytest.raises(LedgerError, match="not at what the sitting announced"):
        node(tmp_path, "p00", ["p00"]).run(1)
    assert Ledger(store).records() == []


def test_an_outcome_about_another_sitting_is_refused(tmp_path: Path) -> None:
    store = forge_run(tmp_path, lambda g: g)
    wrong = Outcome(
        run_id="run",
        round=5,
        sitting=1,
        state=RoundState.CLOSED,
        decided_by="X",
        global_hash="0" * 64,
    )
    store.claim("barrier/00000001.001/decision", store.put(b"X"))
    signed = sign_document(
        identity_of("p00"), "p00", "run/barrier/00000001.001/outcome", encode(wrong)
    )
    store.claim("barrier/00000001.001/outcome", store.put(signed))  # a participant's mistake
    with pytest.raises(LedgerError, match="about another sitting"):
        node(tmp_path, "p00", ["p00"]).run(1)


def test_a_genesis_of_another_run_is_refused(tmp_path: Path) -> None:
    forge_run(tmp_path, lambda g: g.model_copy(update={"run_id": "other"}))
    with pytest.raises(ConfigError, match="the folder's run is 'other'"):
        node(tmp_path, "p00", ["p00"]).run(1)


# -- the documented command ----------------------------------------------------------------
def test_the_demo_script_as_documented(tmp_path: Path) -> None:
    """docs/shared-folder.md's command, as two OS processes: one told its index by flags,
    one by Slurm's environment (as ``srun`` would). (The keys are made in this process,
    by the same ``main`` the command runs: a third interpreter would only add its start.)"""
    command = [sys.executable, "-m", "lensemble_flwr.simulations.shared_folder_demo"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    keys = tmp_path / "keys"  # outside the shared folder
    assert shared_folder_demo.main(["--make-keys", str(keys), "--participants", "2"]) == 0
    folder = tmp_path / "fed"
    common = ["--folder", str(folder), "--keys", str(keys), "--rounds", "2", "--inner-steps", "2"]
    processes = [
        subprocess.Popen(
            [*command, *common, "--participant-index", "0", "--participants", "2"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        ),
        subprocess.Popen(
            [*command, *common],
            stdout=subprocess.PIPE,
            text=True,
            env={**env, "SLURM_PROCID": "1", "SLURM_NTASKS": "2"},
        ),
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in processes] == [0, 0], outputs
    summaries = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert [s["participant"] for s in summaries] == ["p00", "p01"]
    assert len({s["global_hash"] for s in summaries}) == 1
    assert sorted(d[0] for s in summaries for d in s["decided"]) == [1, 2]
    assert "round 2 sitting 1: closed C_t=2" in outputs[1]


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        ([], "--participants and --participant-index are required"),
        (["--participants", "2", "--participant-index", "2"], "must be in"),
    ],
)
def test_the_demo_refuses_an_index_it_cannot_use(
    tmp_path: Path, argv: list[str], complaint: str, monkeypatch: Any, capsys: Any
) -> None:
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    with pytest.raises(SystemExit):
        shared_folder_demo.main(["--folder", str(tmp_path), *argv])
    assert complaint in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_the_demo_refuses_to_run_unauthenticated_unless_told(
    tmp_path: Path, monkeypatch: Any, capsys: Any
) -> None:
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    with pytest.raises(SystemExit):
        argv = ["--folder", str(tmp_path), "--participants", "1", "--participant-index", "0"]
        shared_folder_demo.main(argv)
    assert "pass --keys DIR (see --make-keys), or --unauthenticated" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
