"""Attacks on a run directory's evidence: ``verify`` (and the audit behind
``lensemble-flwr verify``) covers every byte a run directory claims, changes nothing, and
reports what it cannot read (issue 12, §4). Each tamper below went unreported before;
now each is reported, naming the artifact, and a resumed coordinator refuses the run."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from federation_helpers import signed_federation
from run_dir_helpers import (
    ABORTED_ROUND,
    federated_run,
    read_json,
    rewrite_json,
)

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.errors import LedgerError
from lensemble_flwr.identity.signing import IdentityKey
from lensemble_flwr.provenance.audit import audit_run
from lensemble_flwr.provenance.ledger import MANIFEST_HEADER, REGISTRY, manifest_entry_name
from lensemble_flwr.provenance.verify import verify


def header(**changes):
    return lambda run: rewrite_json(run, MANIFEST_HEADER, **changes)


def header_config(**changes):
    def tamper(run: Path) -> None:
        config = read_json(run, MANIFEST_HEADER)["config"] | changes
        rewrite_json(run, MANIFEST_HEADER, config=config)

    return tamper


def closed_entry(**changes):
    return lambda run: rewrite_json(run, manifest_entry_name(1, 1), **changes)


def aborted_entry(**changes):
    return lambda run: rewrite_json(run, manifest_entry_name(ABORTED_ROUND, 1), **changes)


TAMPERS: dict[str, Callable[[Path], object]] = {
    "header: run_id": header(run_id="another-run"),
    "header: root_seed": header(root_seed=12345),
    "header: config claims another min-participants": header_config(**{"min-participants": 1}),
    "header: config claims a stronger DP budget": header_config(**{"dp-epsilon": 1.0}),
    "closed entry: diagnostics": closed_entry(diagnostics={"mean_delta_l2": 123.0}),
    "closed entry: late": closed_entry(late=["p09"]),
    "closed entry: rejected": closed_entry(rejected=7),
    "closed entry: refused": closed_entry(refused={"p03": "PrivacyBudgetExceeded: no"}),
    "closed entry: a secure sum that never happened": closed_entry(secure_sum=True),
    "aborted entry: reason": aborted_entry(reason="FaultToleranceExceeded: nothing to see"),
}


@pytest.mark.parametrize("tamper", TAMPERS.values(), ids=TAMPERS.keys())
def test_every_tamper_of_the_manifest_is_reported_naming_it(run: Path, tamper) -> None:
    assert audit_run(run).ok  # untouched: no false positive
    tamper(run)
    report = audit_run(run)
    assert not report.ok
    fields = {f.field for f in report.findings}
    assert fields & {"ledger.header_digest", "ledger.entries_digest"}, report.findings
    with pytest.raises(LedgerError, match=r"manifest header|manifest entries"):
        verify(Store(run))


@pytest.mark.parametrize("check", ["full", "chain"])
def test_a_swapped_identity_key_in_the_registry_is_refused_by_verify_and_resume(
    tmp_path: Path, check: str
) -> None:
    """A signed federation; someone with write access swaps p01's registered identity key
    for their own. Before, ``resume`` accepted it, admitted the impostor and rejected the
    real participant as forged; now verify names it and resume refuses the run."""
    keys = {f"p0{i}": IdentityKey.generate() for i in range(4)}
    coordinator, _network, _ = signed_federation(tmp_path, keys)
    coordinator.run(2)
    run = tmp_path / "run"
    registry = read_json(run, REGISTRY)
    assert registry["commitments"]["p01"]["identity_key"] == keys["p01"].public_openssh
    registry["commitments"]["p01"]["identity_key"] = IdentityKey.generate().public_openssh
    rewrite_json(run, REGISTRY, **registry)
    report = audit_run(run)
    assert [(f.where, f.field) for f in report.findings] == [
        ("participant registry", "registry.p01")
    ]
    with pytest.raises(LedgerError, match="p01's identity key or dataset root changed"):
        verify(Store(run))
    with pytest.raises(LedgerError, match="p01's identity key"):
        Coordinator.resume(coordinator.config, store=Store(run), check=check)


def test_a_registry_that_forgets_a_participant_or_rebinds_its_root_is_refused(
    run: Path,
) -> None:
    registry = read_json(run, REGISTRY)
    registry["commitments"]["p02"]["dataset_root"] = "ee" * 32
    del registry["commitments"]["p03"]
    rewrite_json(run, REGISTRY, **registry)
    fields = [f.field for f in audit_run(run).findings]
    assert fields == ["registry.p02", "registry"]


def test_verify_writes_nothing_and_works_on_a_read_only_copy(run: Path) -> None:
    (run / "tmp").rmdir()
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    for path in [run, *run.rglob("*")]:
        if path.is_dir():
            path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        report = audit_run(run)
        assert report.ok, report.findings
        assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # no tmp/
    finally:
        for path in [run, *run.rglob("*")]:
            if path.is_dir():
                path.chmod(stat.S_IRWXU)


def test_a_name_file_with_non_utf8_bytes_is_a_finding_not_a_traceback(run: Path) -> None:
    name = run / "names" / "ledger" / "00000002"
    name.write_bytes(b"\xff\xfe not a digest\n")
    report = audit_run(run)
    assert not report.ok
    assert any(f.where == "ledger/00000002" for f in report.findings), report.findings
    odd = run / "names" / "ledger" / os.fsdecode(b"0000\xff")
    odd.write_text("00" * 32 + "\n")
    report = audit_run(run)  # a file name that is not UTF-8 either
    assert not report.ok
    str(report.findings)  # printable


def test_no_false_positives_on_untouched_runs(tmp_path: Path) -> None:
    for i in range(2):
        fresh = federated_run(tmp_path / f"run{i}")
        assert audit_run(fresh).ok
        verify(Store(fresh))


def test_a_registry_of_the_wrong_shape_is_a_finding_not_a_traceback(run: Path) -> None:
    rewrite_json(run, REGISTRY, commitments={"p01": "not a commitment"})
    report = audit_run(run)
    assert [f.where for f in report.findings] == ["participant registry"]
    with pytest.raises(LedgerError, match="participant registry"):
        verify(Store(run))
