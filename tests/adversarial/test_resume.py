"""Attacks on what a restarted coordinator continues from (issue 41, item 2): the
participant registry, the kept external step, the ledger head and the manifest. Each test
reproduces an attack that ``resume`` (and some ``verify``) accepted before; now each is
refused with a ``LedgerError`` naming the artifact, in every check mode, and nothing is
written. Untouched runs still verify and resume."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from federation_helpers import dp_config, federation, signed_federation
from run_dir_helpers import copy_run, read_json, rebind, rewrite_json, synthetic_run

from lensemble_flwr.artifacts.checkpoint import checkpoint_parts
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import digest_arrays
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.coordinator.durable import closing_name
from lensemble_flwr.errors import LedgerError, LensembleError
from lensemble_flwr.identity.signing import IdentityKey
from lensemble_flwr.norms import change_norm
from lensemble_flwr.provenance.audit import audit_run
from lensemble_flwr.provenance.follow import LedgerFollower
from lensemble_flwr.provenance.ledger import (
    EXTERNAL_STEP,
    MANIFEST_HEADER,
    REGISTRY,
    ExternalStep,
    Ledger,
    manifest_entry_name,
)
from lensemble_flwr.provenance.verify import verify
from tests.coordinator.test_external_step import noised
from tests.provenance import test_audit

CHECKS = ["full", "chain", "follower"]


def resume(config, run: Path, check: str, **kwargs) -> Coordinator:
    """``Coordinator.resume`` on ``run`` in one of the three check modes (a fresh
    follower: a process that checks the run for the first time)."""
    store = Store(run)
    if check == "follower":
        kwargs["follower"] = LedgerFollower(store)
    else:
        kwargs["check"] = check
    return Coordinator.resume(config, store=store, **kwargs)


def evidence(run: Path) -> dict[str, bytes]:
    """Every name and blob of a run directory (not tmp/): what a refusal must not change."""
    return {
        str(p.relative_to(run)): p.read_bytes()
        for folder in ("names", "blobs")
        for p in sorted((run / folder).rglob("*"))
        if p.is_file()
    }


def refused(config, run: Path, check: str, match: str) -> None:
    """``resume`` refuses ``run`` with a LedgerError matching ``match`` and writes nothing."""
    before = evidence(run)
    with pytest.raises(LedgerError, match=match):
        resume(config, run, check)
    assert evidence(run) == before


def config_of(run: Path):
    """The config run_dir_helpers.federated_run recorded in ``run`` (read it before a
    tamper)."""
    state_dir = read_json(run, MANIFEST_HEADER)["config"]["dp-state-dir"]
    return dp_config(Path(state_dir), dp_epsilon=50.0)


# -- the participant registry -----------------------------------------------------------------
@pytest.mark.parametrize("check", CHECKS)
def test_a_deleted_registry_is_reported_and_an_impostor_cannot_bind_after_resume(
    tmp_path: Path, check: str
) -> None:
    """Deleting names/coordinator/participants used to pass verify, and the resumed
    coordinator had nobody registered: anyone could commit as p01 with a key of their own.
    Now verify and the audit name the registry, and resume refuses the run."""
    keys = {f"p0{i}": IdentityKey.generate() for i in range(4)}
    coordinator, _network, _ = signed_federation(tmp_path, keys)
    coordinator.run(2)
    run = tmp_path / "run"
    assert read_json(run, REGISTRY)["commitments"]["p01"]["identity_key"]
    (run / "names" / REGISTRY).unlink()
    with pytest.raises(LedgerError, match=f"{REGISTRY} is missing"):
        verify(Store(run))
    report = audit_run(run)
    assert [(f.where, f.field, f.expected) for f in report.findings] == [
        ("participant registry", "registry", REGISTRY)
    ]
    refused(coordinator.config, run, check, f"{REGISTRY} is missing")


def test_a_run_that_never_bound_anyone_needs_no_registry(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path / "syn", [{"a": None, "b": None}] * 2)  # unbound rounds
    assert not (run / "names" / REGISTRY).exists()
    assert [r.registry_digest for r in verify(Store(run))] == [None, None]
    assert audit_run(run).ok


def test_the_shared_folder_refuses_a_deleted_registry(tmp_path: Path) -> None:
    """The shared folder's deciders resume the run's coordinator every sitting (with a
    follower): the next one refuses a registry deleted between two rounds."""
    from tests.shared_folder.test_runner import node, store_of, together

    nodes = [node(tmp_path, "p00"), node(tmp_path, "p01")]
    together(nodes, 1)
    store = store_of(tmp_path)
    records = verify(store)
    assert records[-1].registry_digest is not None
    (store.root / "names" / REGISTRY).unlink()
    with pytest.raises(LedgerError, match=f"{REGISTRY} is missing"):
        verify(store)
    results = together([node(tmp_path, "p00"), node(tmp_path, "p01")], 2)
    assert any(isinstance(r, LedgerError) and REGISTRY in str(r) for r in results), results
    assert [r.round for r in Ledger(store).records()] == [1]  # nothing committed since


# -- the kept external step ---------------------------------------------------------------------
def hand_written_step(coordinator: Coordinator, committed_hash: str | None = None) -> ExternalStep:
    """An external step written into the store by hand: an arbitrary model (not the
    coordinator's), with a checkpoint and a change norm that fit it."""
    store = coordinator.store
    committed = coordinator.global_state()
    model = {n: np.full_like(a, 7.0) for n, a in committed.params.items()}
    adopted_hash = digest_arrays(model, "params")
    digest = store.put_parts(
        checkpoint_parts(committed.round, model, coordinator.momentum(), params_hash=adopted_hash)
    )
    step = ExternalStep(
        committed_hash=committed_hash or committed.params_hash,
        adopted_hash=adopted_hash,
        checkpoint=digest,
        change_norm=change_norm(committed.params, model),
    )
    store.bind(EXTERNAL_STEP, store.put(json.dumps(step.model_dump(mode="json")).encode()))
    return step


@pytest.mark.parametrize("check", CHECKS)
def test_a_hand_written_step_for_a_round_that_already_started_is_refused(
    tmp_path: Path, check: str
) -> None:
    """Round 3 started from the committed model (its attempt aborted); a step written by
    hand afterwards would have the resumed coordinator train round 3 from another model."""
    coordinator, network, _ = federation(tmp_path)
    coordinator.run(2)
    coordinator.begin_attempt()
    coordinator.abort(LedgerError("stopped by the test"))
    network.flush()
    hand_written_step(coordinator)
    run = tmp_path / "run"
    with pytest.raises(LedgerError, match=f"{EXTERNAL_STEP}: round 3 attempt 1"):
        verify(Store(run))
    assert EXTERNAL_STEP in {f.where for f in audit_run(run).findings}
    refused(coordinator.config, run, check, f"{EXTERNAL_STEP}: round 3 attempt 1")


@pytest.mark.parametrize("check", CHECKS)
def test_a_hand_written_step_for_a_round_cut_short_is_refused(tmp_path: Path, check: str) -> None:
    """Round 3's first attempt started from the committed model and the coordinator died
    in it (no manifest entry, only its start marker): the marker says which model it
    started from, so a step written by hand afterwards is refused."""
    coordinator, network, _ = federation(tmp_path)
    coordinator.run(2)
    coordinator.begin_attempt()  # the process dies here
    network.flush()
    hand_written_step(coordinator)
    run = tmp_path / "run"
    refused(coordinator.config, run, check, "attempts/00000003-0001.*from the committed model")


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("finished", [True, False], ids=["aborted attempt", "cut short"])
def test_a_removed_pending_step_is_refused(tmp_path: Path, check: str, finished: bool) -> None:
    """Round 2 trains from a model a step adopted (a wrapper's central noise); deleting
    the kept step would have the resumed coordinator train round 2 from the model it
    replaced, releasing the un-noised aggregate."""
    coordinator, network, _ = federation(tmp_path)
    coordinator.run(1)
    step = coordinator.adopt(noised(coordinator))
    coordinator.begin_attempt()
    if finished:
        coordinator.abort(LedgerError("stopped by the test"))
    network.flush()
    run = tmp_path / "run"
    (run / "names" / EXTERNAL_STEP).unlink()
    if finished:  # the manifest entry says so: verify and the audit see it too
        with pytest.raises(LedgerError, match=f"{EXTERNAL_STEP} is missing"):
            verify(Store(run))
        assert EXTERNAL_STEP in {f.where for f in audit_run(run).findings}
    refused(
        coordinator.config,
        run,
        check,
        f"{EXTERNAL_STEP}.*{'missing' if finished else step.adopted_hash[:12]}",
    )


@pytest.mark.parametrize("check", CHECKS)
def test_a_hand_written_step_that_no_record_holds_is_refused(tmp_path: Path, check: str) -> None:
    """A step that starts from an older round's model (or θ_0) and that no record trained
    from was kept by no coordinator (it changes only the model it just committed)."""
    coordinator, network, _ = federation(tmp_path)
    coordinator.run(2)
    network.flush()
    first = Ledger(coordinator.store).records()[0]
    hand_written_step(coordinator, committed_hash=first.new_global_hash)
    run = tmp_path / "run"
    with pytest.raises(LedgerError, match=f"{EXTERNAL_STEP} is no ledger record's"):
        verify(Store(run))
    refused(coordinator.config, run, check, f"{EXTERNAL_STEP} is no ledger record's")


@pytest.mark.parametrize("check", CHECKS)
def test_a_kept_step_with_a_lying_change_norm_or_checkpoint_is_refused(
    tmp_path: Path, check: str
) -> None:
    coordinator, network, _ = federation(tmp_path)
    coordinator.run(1)
    step = coordinator.adopt(noised(coordinator))
    network.flush()
    run = tmp_path / "run"
    for forged, match in [
        (step.model_copy(update={"change_norm": step.change_norm * 2}), "change norm"),
        (step.model_copy(update={"checkpoint": Ledger(coordinator.store).records()[0].checkpoint}),
         "does not hold"),
    ]:  # fmt: skip
        rebind(run, EXTERNAL_STEP, json.dumps(forged.model_dump(mode="json")).encode())
        with pytest.raises(LedgerError, match=EXTERNAL_STEP):
            verify(Store(run))
        refused(coordinator.config, run, check, f"{EXTERNAL_STEP}.*{match}")


@pytest.mark.parametrize("check", CHECKS)
def test_the_coordinators_own_steps_verify_and_resume(tmp_path: Path, check: str) -> None:
    """No false positive: a pending step, and one a later round already trained from."""
    coordinator, network, _ = federation(tmp_path)
    coordinator.run(1)
    step = coordinator.adopt(noised(coordinator))
    network.flush()
    run = tmp_path / "run"
    verify(Store(run))
    assert audit_run(run).ok
    resumed = resume(coordinator.config, run, check, transport=coordinator.transport)
    assert resumed.global_state().params_hash == step.adopted_hash
    resumed.run(2)
    network.flush()
    assert verify(Store(run))[1].external_step == step  # still kept: a record holds it
    assert Store(run).bound(EXTERNAL_STEP)
    assert audit_run(run).ok
    assert resume(coordinator.config, run, check).global_state().round == 3


# -- the ledger head and the manifest -----------------------------------------------------------
@pytest.mark.parametrize("check", CHECKS)
def test_a_deleted_head_record_is_refused_naming_it(run: Path, check: str) -> None:
    config = config_of(run)
    (run / "names" / "ledger" / "00000003").unlink()
    with pytest.raises(LedgerError, match="ledger/00000003"):
        verify(Store(run))
    refused(config, run, check, "ledger/00000003")


@pytest.mark.parametrize("check", CHECKS)
def test_a_closing_entry_that_is_not_the_committed_one_is_refused_before_it_is_written(
    run: Path, check: str
) -> None:
    """The head's manifest entry gone, and the entry kept before its commit rewritten:
    resume used to write the rewritten entry into the manifest before it verified."""
    config = config_of(run)
    (run / "names" / manifest_entry_name(3, 1)).unlink()
    rewrite_json(run, closing_name(3, 1), late=["p09"])
    refused(config, run, check, closing_name(3, 1))


def pending_attempt(run: Path, round: int, attempt: int, **changes) -> None:
    """An aborted attempt of ``round`` stored by hand under its own name."""
    entry = read_json(run, manifest_entry_name(2, 1)) | {"round": round, "attempt": attempt}
    entry["prior_global_hash"] = read_json(run, "ledger/00000003")["new_global_hash"]
    rebind(run, manifest_entry_name(round, attempt), json.dumps(entry | changes).encode())


MANIFEST_TAMPERS: dict[str, tuple[Callable[[Path], object], str]] = {
    "an attempt of a round after the one in flight": (
        lambda run: pending_attempt(run, 5, 1),
        "00000005-0001: an attempt of round 5, yet the ledger ends at round 3",
    ),
    "an attempt of the round in flight from another model": (
        lambda run: pending_attempt(run, 4, 1, prior_global_hash="ab" * 32),
        "00000004-0001: .*prior global hash",
    ),
    "an aborted attempt of the round in flight with a new model": (
        lambda run: pending_attempt(run, 4, 1, new_global_hash="ab" * 32),
        "00000004-0001: .*aborted attempt records a new global hash",
    ),
    "the round in flight's attempts out of order": (
        lambda run: pending_attempt(run, 4, 2),
        "attempt 2 is numbered out of order",
    ),
    "an entry under another attempt's name": (
        lambda run: (run / "names" / manifest_entry_name(4, 1)).write_text(
            (run / "names" / manifest_entry_name(2, 1)).read_text()
        ),
        "00000004-0001 holds the entry of round 2 attempt 1",
    ),
}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("tamper", MANIFEST_TAMPERS.values(), ids=MANIFEST_TAMPERS.keys())
def test_manifest_tampers_past_the_head_are_refused_by_verify_and_resume(
    run: Path, check: str, tamper
) -> None:
    """Entries past the newest record are committed by no record yet: the audit reported
    these, but verify() and resume did not look (round 5 with no round 4 is the audit's
    own skip_a_round)."""
    change, match = tamper
    config = config_of(run)
    change(run)
    assert not audit_run(run).ok
    with pytest.raises(LedgerError, match=match):
        verify(Store(run))
    refused(config, run, check, match)


CHECKPOINT_ONLY = {  # chain checks read only the checkpoint they resume from
    test_audit.flip_checkpoint_byte,
    test_audit.delete_checkpoint,
    test_audit.point_record_at_a_non_checkpoint,
    test_audit.flip_initial_checkpoint_byte,
}


@pytest.mark.parametrize(
    ("tamper", "check"),
    [
        pytest.param(tamper, check, id=f"{tamper.__name__}-{check}")
        for tamper in test_audit.TAMPERS
        for check in CHECKS
        if check == "full" or tamper not in CHECKPOINT_ONLY
    ],
)
def test_resume_refuses_every_tamper_the_audit_reports(run: Path, tamper, check: str) -> None:
    """Resume runs the checks verify runs: every tamper of tests/provenance/test_audit.py
    (in chain modes, those of the checkpoints it does not read aside) is refused, and the
    refusal writes nothing."""
    config = config_of(run)
    tamper(run)
    before = evidence(run)
    with pytest.raises(LensembleError):
        resume(config, run, check)
    assert evidence(run) == before


@pytest.mark.parametrize("check", CHECKS)
def test_untouched_runs_verify_and_resume(pristine: Path, tmp_path: Path, check: str) -> None:
    run = copy_run(pristine, tmp_path / "run")
    assert audit_run(run).ok
    verify(Store(run))
    resumed = resume(config_of(run), run, check)
    assert resumed.global_state().round == 3
